"""The river itself: how it is configured, built and removed, what a twin is, where a step's exit is decided and what
the layers it skips do about their KV, and the `generate()` hook that runs it.

    config.py (RiverQuantConfig: how the river is built)   settings.py (RiverSettings: how one call exits)
    build.py (build_river / remove_river)                    twins.py (RiverLayer: a decoder layer and its twin)
    exit_decision.py (ExitRouter) + signals.py              kv_strategies.py + kv_cache.py (RiverCache)
    generation.py (RiverConfig, the generate hook)           captured_decode.py (static cache, compiled steps)
"""
