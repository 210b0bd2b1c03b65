"""Gated DeltaNet backends (Qwen3.5). Filled in by the Qwen3.5 work; names are validated here."""

GDN_BACKENDS = {"auto": None, "torch_ref": None, "fla": None}
