"""Backbone offloading (the paper's fourth step): the backbone layers that tokens rarely reach leave the execution
device and page in only when a step runs them; the twins (and the quantized LM head) stay resident.

    river_hf.offload_backbone(model, layers=[2, 3, 4, 5], to="disk")   # or layers="auto" (offload_choice.py)
    river_hf.reload_backbone(model)                                    # the exact weights back on the device

Built on accelerate's offload machinery, not a pager of our own: every offloaded module gets an `AlignDevicesHook`
(offload=True) whose `weights_map` is an `OffloadedWeightsLoader`. Between calls the module's parameters are on the
meta device; the hook puts them on the execution device for its forward and back on meta after it.
- `to="disk"`: the weights go to one safetensors file per layer (index written with `save_offload_index`). The loader
  opens it with safetensors, which memory-maps the file: on CPU a step computes straight from the mapped, file-backed
  pages (the page cache, which the kernel may drop), so the weights are not in the process's anonymous memory.
- `to="cpu"` (CUDA models): the weights are kept in pinned CPU memory and copied to the GPU for each call.

Only modules none of whose own tensors the twin shares are offloaded: a twin is a copy of its backbone layer that
shares every non-linear parameter (norms, `skip_modules` linears) with it, and those must stay where they are, the
same Parameter objects, so the twin computes exactly what it did. In practice: the backbone's nn.Linear weights.
`model.hf_device_map` names the offloaded modules ("disk" / "cpu"), which is how transformers' `save_pretrained`
knows to read them back (`load_offloaded_parameter`), and why generate does not compile an offloaded model.
Not thread-safe: the hooks swap a module's weights in and out, so run one generate at a time on an offloaded model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field

import torch
try:  # a declared dependency; should it be missing, river_hf still imports and offload_backbone says what to install
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, save_offload_index
    ACCELERATE_MISSING = False
except ModuleNotFoundError:
    AlignDevicesHook, ACCELERATE_MISSING = object, True  # no hook of ours can exist: reload_backbone has nothing to do
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from ..core.architectures import find_decoder_layers
from ..checks import check_choice, install_hint
from ..core.config import OFFLOAD_DESTINATIONS
from ..core.freed_memory import release_freed_memory
from ..core.twins import RiverLayer, river_layers
from .choice import choose_layers
from ..cache_folder import data_root



@dataclass
class PageInStats:
    """What the offload hooks of one `offload_backbone` call did: module loads and the seconds they took (CPU wall
    time of the hooks' pre_forward; on CUDA it includes waiting for queued kernels before the copy)."""

    loads: int = 0
    seconds: float = 0.0
    loads_by_layer: dict[int, int] = field(default_factory=dict)

    def add(self, layer_idx: int, seconds: float) -> None:
        self.loads += 1
        self.seconds += seconds
        self.loads_by_layer[layer_idx] = self.loads_by_layer.get(layer_idx, 0) + 1

    def reset(self) -> None:
        self.loads, self.seconds, self.loads_by_layer = 0, 0.0, {}


class OffloadStore:
    """Where one `offload_backbone` call keeps its weights: a folder of safetensors files ("disk") or a dict of
    pinned CPU tensors ("cpu"), behind one `OffloadedWeightsLoader`. A folder it made is removed by `cleanup`,
    `reload_backbone`, or when the store is garbage-collected / the interpreter exits."""

    def __init__(self, to: str, device: torch.device, layers: list[int], folder: str | None = None):
        self.to, self.device, self.layers = to, device, layers
        self.folder = folder
        self.loader: OffloadedWeightsLoader | None = None
        self.stats = PageInStats()
        self.offloaded_bytes = 0
        self.previous_device_map = None
        self._remove_folder = weakref.finalize(self, shutil.rmtree, folder, True) if folder else None

    def write(self, tensors_by_layer: dict[int, dict[str, torch.Tensor]], progress: bool = False) -> None:
        """Store every tensor ({layer: {full name: tensor}}) and open the loader on them; `progress` shows a bar
        per layer file (a large model writes gigabytes)."""
        self.offloaded_bytes = sum(t.numel() * t.element_size()
                                   for ts in tensors_by_layer.values() for t in ts.values())
        if self.to == "cpu":
            self.loader = OffloadedWeightsLoader(state_dict={
                name: _pinned_copy(tensor)
                for tensors in tensors_by_layer.values() for name, tensor in tensors.items()})
            return
        index = {}
        for layer_idx, tensors in tqdm(tensors_by_layer.items(), desc="river: offloading backbone layers",
                                       unit="layer", disable=not progress):
            path = os.path.join(self.folder, f"layer-{layer_idx:04d}.safetensors")
            save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}, path)
            index.update({name: {"safetensors_file": path, "weight_name": name} for name in tensors})
        save_offload_index(index, self.folder)
        self.loader = OffloadedWeightsLoader(save_folder=self.folder)

    def cleanup(self) -> None:
        if self._remove_folder is not None:
            self._remove_folder()


class BackboneOffloadHook(AlignDevicesHook):
    """accelerate's `AlignDevicesHook` (offload=True) that also counts its page-ins into its store's stats, and
    marks the module as offloaded by river_hf (so `reload_backbone` takes off only its own hooks)."""

    def __init__(self, store: OffloadStore, layer_idx: int, **kwargs):
        super().__init__(offload=True, **kwargs)
        self.store, self.layer_idx = store, layer_idx

    def pre_forward(self, module, *args, **kwargs):
        started = time.perf_counter()
        result = super().pre_forward(module, *args, **kwargs)
        self.store.stats.add(self.layer_idx, time.perf_counter() - started)
        return result


def offload_backbone(model: nn.Module, layers="auto", to: str = "disk", folder: str | None = None,
                     progress: bool = True, **auto) -> nn.Module:
    """Move the backbone weights of decoder `layers` (from `start_layer` on) off the execution device; they page in
    for each step that runs those backbone layers. Returns the same model.

    `layers`: decoder-layer indices, or "auto": the layers that run for fewer than `max_share` of decoded tokens in a
    measured exit-depth histogram (`histogram=`, or measured now from `inputs=` and `generation_config=`: see
    `offload_choice.choose_layers`). `to`: "disk" (safetensors files in `folder`, default
    $RIVER_HF_CACHE/offload or ~/.cache/river_hf/offload, a fresh subfolder per call) or "cpu" (CUDA models only).
    `progress`: a progress bar while the files are written. On any error nothing is left offloaded and no file is
    left behind."""
    if ACCELERATE_MISSING:
        raise ModuleNotFoundError(f"`offload_backbone` {install_hint('accelerate')}.")
    check_choice("to", to, OFFLOAD_DESTINATIONS)
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise ValueError(f"`folder` must be None or a folder path (str or os.PathLike); got {folder!r}.")
    wrapped = river_layers(model)  # a clear error for a model without a river
    if offloaded_layers(model):
        raise ValueError(f"`model` already has offloaded backbone layers {offloaded_layers(model)}; call "
                         f"river_hf.reload_backbone(model) before offloading again.")
    indices = choose_layers(model, wrapped, layers, **auto)
    if not indices:
        return model  # "auto" found no layer rare enough (choose_layers warned)
    plan = offload_plan(model, wrapped, indices)
    device = _execution_device(plan)
    check_destination(to, device)
    store = OffloadStore(to, device, indices, _new_folder(folder) if to == "disk" else None)
    attached = []
    try:
        store.write({idx: {f"{name}.{key}": tensor for name, module, layer in plan if layer == idx
                           for key, tensor in module.named_parameters(recurse=False)} for idx in indices}, progress)
        for name, module, layer in plan:
            add_hook_to_module(module, BackboneOffloadHook(store, layer, execution_device=device,
                                                           weights_map=PrefixedDataset(store.loader, f"{name}.")))
            attached.append(module)
    except BaseException:
        for module in attached:
            remove_hook_from_module(module)
        store.cleanup()
        raise
    _mark_device_map(model, store, [name for name, _, _ in plan])
    release_freed_memory()  # the resident copies just dropped: RssAnon falls now, not whenever glibc reuses them
    return model


def reload_backbone(model: nn.Module) -> nn.Module:
    """Put every offloaded backbone weight back on its device, in memory, exactly as it was; removes the offload
    files. A no-op on a river model with nothing offloaded. Returns the same model."""
    hooked = _offload_hooks(river_layers(model))
    stores = list({id(hook.store): hook.store for _, hook in hooked}.values())
    for module, hook in hooked:
        # accelerate's detach_hook puts the weights_map's tensors back: give it in-memory copies, not the mapped file
        hook.weights_map = {key: hook.weights_map[key].clone() for key, _ in module.named_parameters(recurse=False)}
        remove_hook_from_module(module)
    for store in stores:
        _restore_device_map(model, store)
        store.cleanup()
    return model


def offloaded_layers(model: nn.Module) -> list[int]:
    """The decoder layers whose backbone weights are offloaded now (empty when none, or without a river)."""
    return sorted({hook.layer_idx for _, hook in _offload_hooks(_wrapped(model))})


def offload_stores(model: nn.Module) -> list[OffloadStore]:
    """The stores behind the model's offloaded layers (their page-in stats, bytes, folder)."""
    return list({id(hook.store): hook.store for _, hook in _offload_hooks(_wrapped(model))}.values())


def offload_plan(model: nn.Module, wrapped: list[RiverLayer], indices: list[int]) -> list[tuple[str, nn.Module, int]]:
    """(name in the backbone's own state_dict, module, layer index) for every module to offload: the backbone layer's
    modules with parameters of their own, none of which its twin shares (a twin shares norms and skipped linears)."""
    prefix = _layers_prefix(model)
    plan = []
    for idx in indices:
        layer = wrapped[idx]
        shared = {id(t) for t in (*layer.twin.parameters(), *layer.twin.buffers())}
        for sub_name, module in layer.base_layer.named_modules():
            own = list(module.parameters(recurse=False))
            if own and not any(id(t) in shared for t in own):
                _refuse_foreign_hook(module, idx, sub_name)
                plan.append((".".join(filter(None, (prefix, str(idx), sub_name))), module, idx))
    return plan


def weight_residency(model: nn.Module) -> dict:
    """Bytes of the model's distinct tensors (parameters and buffers) per device type they are on now ("meta": held
    by an offload store instead), and the bytes the offload stores hold."""
    by_device: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        by_device[tensor.device.type] = by_device.get(tensor.device.type, 0) + tensor.numel() * tensor.element_size()
    stores = offload_stores(model)
    return {"bytes_by_device": by_device, "offloaded_bytes": sum(store.offloaded_bytes for store in stores),
            "offloaded_to": sorted({store.to for store in stores})}


# ---------------------------------------------------------------- helpers


def _wrapped(model: nn.Module) -> list[RiverLayer]:
    """The model's RiverLayers; none for a plain model (nothing of it is offloaded by river_hf)."""
    return [layer for layer in find_decoder_layers(model) if isinstance(layer, RiverLayer)]


def _offload_hooks(wrapped: list[RiverLayer]) -> list[tuple[nn.Module, BackboneOffloadHook]]:
    return [(module, module._hf_hook) for layer in wrapped for module in layer.base_layer.modules()
            if isinstance(getattr(module, "_hf_hook", None), BackboneOffloadHook)]


def _refuse_foreign_hook(module: nn.Module, idx: int, sub_name: str) -> None:
    if getattr(module, "_hf_hook", None) is not None:
        raise ValueError(
            f"`model`: decoder layer {idx}'s `{sub_name}` already carries an accelerate hook (a device_map or "
            f"cpu_offload dispatch); offload_backbone places the backbone itself. Load the model without a "
            f"device_map (on one device) and offload with river_hf.offload_backbone."
        )


def _layers_prefix(model: nn.Module) -> str:
    layers = find_decoder_layers(model)
    return next(name for name, module in model.named_modules() if module is layers)


def _execution_device(plan) -> torch.device:
    devices = {param.device for _, module, _ in plan for param in module.parameters(recurse=False)}
    if len(devices) != 1:
        raise ValueError(f"`layers`: the backbone layers to offload live on several devices "
                         f"({sorted(map(str, devices))}); "
                         f"offload_backbone needs the model on one device.")
    return devices.pop()


def check_destination(to: str, device: torch.device) -> None:
    if to == "cpu" and device.type == "cpu":
        raise ValueError(f"`to`='cpu': the model runs on {device}, so its weights already are in CPU memory and "
                         f"nothing would leave the device. On CPU use to='disk' (memory-mapped safetensors files).")


def _new_folder(folder: str | None) -> str:
    """A fresh subfolder of `folder` (made if missing) for this call's files; a clear error when it is not writable."""
    root = folder if folder is not None else os.path.join(data_root(), "offload")
    try:
        os.makedirs(root, exist_ok=True)
        return tempfile.mkdtemp(prefix="river-offload-", dir=root)
    except (OSError, ValueError) as error:  # ValueError: a path the system refuses outright (a NUL byte)
        reason = getattr(error, "strerror", None) or error
        raise ValueError(f"`folder`={str(root)!r} is not writable ({reason}); pass a folder you can "
                         f"write to (to='disk' writes the offloaded weights there).") from error


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a (CUDA) weight, page-locked so that copying it back to the GPU is fast."""
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return pinned.copy_(tensor.detach())


def _mark_device_map(model: nn.Module, store: OffloadStore, names: list[str]) -> None:
    """`hf_device_map` is transformers' record of where modules live: with "disk"/"cpu" entries, save_pretrained
    reads the offloaded weights back from the hooks, and generate does not compile the model."""
    store.previous_device_map = getattr(model, "hf_device_map", None)
    base = dict(store.previous_device_map) if store.previous_device_map else {"": str(store.device)}
    model.hf_device_map = {**base, **{name: store.to for name in names}}


def _restore_device_map(model: nn.Module, store: OffloadStore) -> None:
    if store.previous_device_map is None:
        model.__dict__.pop("hf_device_map", None)
    else:
        model.hf_device_map = store.previous_device_map
