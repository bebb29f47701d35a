"""flashdraft's version: what caches and records are keyed on."""

__version__ = "0.1.0"
