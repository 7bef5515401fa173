"""Callbacks: the base class and handler, plus one file per built-in callback."""

from .base import CallbackHandler, ExportableState, TrainerCallback, EVENTS
from .early_stopping import EarlyStoppingCallback
from .flow import DefaultFlowCallback
from .progress import PrinterCallback, ProgressCallback

__all__ = [
    "CallbackHandler", "ExportableState", "TrainerCallback", "EVENTS", "EarlyStoppingCallback",
    "DefaultFlowCallback", "PrinterCallback", "ProgressCallback",
]
