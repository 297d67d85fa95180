"""tensorlens's version, in a module of its own that imports nothing: code inside the package reads
it from here (importing ``tensorlens`` for it would be an import of the package from within)."""

__version__ = "0.1.0"
