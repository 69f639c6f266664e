"""The one error a config raises, whichever section finds the problem."""


class ConfigError(ValueError):
    """A config that cannot describe a valid build: one line naming the key and what is allowed."""
