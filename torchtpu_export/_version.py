"""The package's version, in a module of its own: converters and formats read it without importing the package."""
__version__ = "0.1.0"
