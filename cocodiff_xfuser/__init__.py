"""cocodiff-xfuser: a communication-efficient sequence-parallel backend for xDiT (xfuser).

Importing this package is cheap (no torch import): the ``.pth`` hook that activates the
backend imports it in every interpreter.
"""

__version__ = "0.1.0"
