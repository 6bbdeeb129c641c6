"""Lossless mode: the river drafts, the backbone verifies, in one cache (docs/lossless.md). `decode.py` runs it (a
`custom_generate` function); `acceptance.py` keeps drafted tokens; `draft_control.py` sizes drafts and falls back;
`exact_rows.py` makes verification compute every row as a one-token step would.

`river_hf.lossless` was one module before the subpackages; its names still import from here."""

from .decode import LosslessCache, forget_fallbacks  # noqa: F401  (the old module's names)
