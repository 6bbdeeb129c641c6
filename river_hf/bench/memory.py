"""One system's memory, measured in a process of its own: `python -m river_hf.bench.memory < job.json` prints one JSON
line. (RSS does not reliably go down within a process, so `bench --offload` starts one of these per system.)

The job names the model (`offload.ModelSpec`), the system (backbone, static-full-quant, river, river+offload), one
prompt's token ids and the river settings. The process loads and builds the system, frees what the system does not
keep (gc, then glibc's malloc_trim), reads /proc/self/status (RssAnon: private anonymous memory; RssFile: file-backed
pages, e.g. libraries and memory-mapped weights; VmRSS: their total with shared memory), then resets the peak
(`/proc/self/clear_refs` 5) and decodes once while a thread samples RssAnon every 2 ms: the decode peaks. Linux only.
"""

from __future__ import annotations

import contextlib

import json
import sys
import threading

import torch
from transformers import GenerationConfig

from ..core.config import RiverQuantConfig
from ..core.freed_memory import release_freed_memory
from ..core.generation import RiverConfig
from ..loading.models import load_model_and_tokenizer
from ..offload.backbone import offload_backbone, weight_residency
from ..core.build import build_river
from ..kernels.quantize import plain_rounding
from .shapes import random_model
from .systems import fixed_length, static_full_quant

STATUS_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")


def proc_status() -> dict[str, int]:
    """The memory fields of /proc/self/status, in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in STATUS_FIELDS:
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS


class AnonSampler(threading.Thread):
    """Samples RssAnon and VmRSS until stopped; keeps the maxima."""

    def __init__(self, interval_s: float = 0.002):
        super().__init__(daemon=True)
        self.interval_s, self.peaks, self._stop_event = interval_s, {"RssAnon": 0, "VmRSS": 0}, threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            status = proc_status()
            for key in self.peaks:
                self.peaks[key] = max(self.peaks[key], status[key])

    def stop(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return self.peaks


def load_system(job: dict):
    """(model to generate with, generation config) of the job's system, everything it does not keep freed."""
    spec, system, fixed = job["spec"], job["system"], fixed_length(job["max_new_tokens"])
    if spec["random_model"]:
        model = random_model(spec["random_model"], seed=spec["seed"], device=spec["device"],
                             dtype=getattr(torch, spec["dtype"]))
    else:
        model, _ = load_model_and_tokenizer(spec["model"], spec["gguf_file"], dtype=getattr(torch, spec["dtype"]),
                                            device=spec["device"])
    if system == "backbone":
        return model, GenerationConfig(**fixed)
    # random weights: the same plain rounding as the parent's build (same kernels and bytes, seconds not minutes)
    with plain_rounding() if spec["random_model"] else contextlib.nullcontext():
        build_river(model, RiverQuantConfig.from_dict(spec["quant"]), progress=False)
    if system == "static-full-quant":  # the twins as plain layers: the river model, and with it the backbone
        return static_full_quant(model), GenerationConfig(**fixed)  # layers they replace, is freed on return
    if system == "river+offload" and job["offload"]["layers"]:
        offload = job["offload"]
        offload_backbone(model, layers=offload["layers"], to=offload["to"], folder=offload["folder"], progress=False)
    return model, RiverConfig(**job["river"], **fixed)


@torch.no_grad()
def measure(job: dict) -> dict:
    model, config = load_system(job)
    release_freed_memory()
    built = proc_status()
    ids = torch.tensor([job["input_ids"]], device=job["spec"]["device"])
    reset_peak()
    sampler = AnonSampler()
    sampler.start()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    peaks = sampler.stop()
    after = proc_status()
    residency = weight_residency(model)
    device_type = torch.device(job["spec"]["device"]).type
    return {"system": job["system"], "rss_anon_built_bytes": built["RssAnon"], "rss_file_built_bytes": built["RssFile"],
            "rss_built_bytes": built["VmRSS"], "peak_rss_before_decode_bytes": built["VmHWM"],
            "peak_anon_decode_bytes": max(peaks["RssAnon"], after["RssAnon"]),
            "peak_rss_decode_bytes": after["VmHWM"], "rss_file_after_decode_bytes": after["RssFile"],
            "resident_weight_bytes": residency["bytes_by_device"].get(device_type, 0),
            "offloaded_weight_bytes": residency["offloaded_bytes"],
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if device_type == "cuda" else None}


def main() -> int:
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(torch.get_num_threads())
    print(json.dumps(measure(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
