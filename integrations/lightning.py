"""The tensorlens callback for ``lightning.pytorch`` (``pip install 'tensorlens[lightning]'``).

>>> from lightning.pytorch import Trainer                                     # doctest: +SKIP
>>> from tensorlens.integrations.lightning import TensorLensCallback           # doctest: +SKIP
>>> trainer = Trainer(callbacks=[TensorLensCallback()], logger=WandbLogger())  # doctest: +SKIP

For the standalone ``pytorch_lightning`` package use
:mod:`tensorlens.integrations.pytorch_lightning`: a Trainer accepts callbacks of its own namespace only.
"""

from __future__ import annotations

try:
    import lightning.pytorch as _namespace
except ImportError as err:  # the message names the extra to install
    from tensorlens.integrations._lightning_callback import missing_namespace

    raise missing_namespace("lightning", "lightning", err) from err

from tensorlens.integrations._lightning_callback import CLIPPED_GRADIENTS, TensorLensCallbackBase

__all__ = ["CLIPPED_GRADIENTS", "TensorLensCallback"]


class TensorLensCallback(TensorLensCallbackBase, _namespace.Callback):
    __doc__ = TensorLensCallbackBase.__doc__
    _namespace = _namespace
    _extra = "lightning"
