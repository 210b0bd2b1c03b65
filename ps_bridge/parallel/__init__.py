"""Parallel runs: `settings` (what is supported, refused, and set on the provider), `groups`
(process groups), `gradients` (gradient finishing, HF-named gradients). Import from the submodule."""
