"""The tensorlens callback for the standalone ``pytorch_lightning`` package
(``pip install 'tensorlens[pytorch-lightning]'``).

>>> from pytorch_lightning import Trainer                                            # doctest: +SKIP
>>> from tensorlens.integrations.pytorch_lightning import TensorLensCallback         # doctest: +SKIP
>>> trainer = Trainer(callbacks=[TensorLensCallback()], logger=TensorBoardLogger("logs"))  # doctest: +SKIP

For the unified ``lightning`` package (``lightning.pytorch``) use
:mod:`tensorlens.integrations.lightning`: a Trainer accepts callbacks of its own namespace only.
"""

from __future__ import annotations

try:
    import pytorch_lightning as _namespace
except ImportError as err:  # the message names the extra to install
    from tensorlens.integrations._lightning_callback import missing_namespace

    raise missing_namespace("pytorch_lightning", "pytorch-lightning", err) from err

from tensorlens.integrations._lightning_callback import CLIPPED_GRADIENTS, TensorLensCallbackBase

__all__ = ["CLIPPED_GRADIENTS", "TensorLensCallback"]


class TensorLensCallback(TensorLensCallbackBase, _namespace.Callback):
    __doc__ = TensorLensCallbackBase.__doc__
    _namespace = _namespace
    _extra = "pytorch-lightning"
