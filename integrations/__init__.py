"""Trainer integrations: `ampwatch.integrations.transformers`, `.lightning`, `.accelerate`.

Each module imports its framework; the agent never imports them (install the extras
`ampwatch[transformers]` or `ampwatch[lightning]`).
"""
