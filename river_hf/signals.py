"""Exit signals: what decides, after a backbone layer, that a decoded token may leave for the twins.

(Being filled in: see issue 5.)
"""

EXIT_SIGNALS = ("cosine", "cosine_first", "update_norm", "random")
