"""Progress bars: widgets in Jupyter and Colab, text in a terminal.

`tqdm` is `tqdm.auto.tqdm`, which picks the kind of bar when this module
is first imported. In a notebook kernel without ipywidgets it falls back
to the text bar, which is fine, and warns (`TqdmWarning`, "IProgress not
found") when specjax is imported; that warning is dropped.
"""

from __future__ import annotations

import warnings

import tqdm as tqdm_lib

with warnings.catch_warnings():
  warnings.simplefilter("ignore", tqdm_lib.TqdmWarning)
  from tqdm import auto  # pylint: disable=g-import-not-at-top

__all__ = ["tqdm"]

tqdm = auto.tqdm
