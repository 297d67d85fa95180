"""Adapters for optional libraries, installed as ``tensorlens.integrations``.

Each submodule imports its vendor library lazily and, if it is missing, raises an ImportError
naming the extra to install (``pip install 'tensorlens[wandb]'``).
"""
