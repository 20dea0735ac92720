"""TensorRT optimization profiles derived from an ONNX model's dynamic axes.

TensorRT builds an engine for a range of input shapes (a profile: min, opt, max).
The model says which axes are dynamic (a ``dim_param`` or a missing ``dim_value``);
the configured batch sizes say how far the batch axis goes. ``profile_shapes`` turns
both into shapes, ``tensorrt_provider_options`` into ONNX Runtime's TensorRT
provider options (``trt_profile_min_shapes`` ... in its ``name:AxBxC`` syntax), and
``simulations.cli_engine`` into a native engine's profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["InputProfile", "format_shapes", "profile_shapes", "tensorrt_provider_options"]


@dataclass(frozen=True)
class InputProfile:
    """One input's shapes for a TensorRT optimization profile."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def _dims(model: Any) -> list[tuple[str, list[int | None]]]:
    """(name, dims) of the graph inputs that are not initializers; None = dynamic."""
    initializers = {init.name for init in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims: list[int | None] = []
        for dim in value.type.tensor_type.shape.dim:
            dims.append(dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None)
        out.append((value.name, dims))
    return out


def profile_shapes(
    model: Any,
    batch_sizes: Sequence[int],
    *,
    default_hw: tuple[int, int] | None = None,
) -> list[InputProfile]:
    """Profiles for every input: the batch axis (axis 0) spans min..max of ``batch_sizes``
    with the largest as the optimum (the verifier's saturated batch); any other dynamic
    axis takes ``default_hw`` (H, W of an NHWC or NCHW image) or fails with a reason."""
    import onnx

    if isinstance(model, str | Path):
        model = onnx.load(str(model), load_external_data=False)
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    profiles = []
    for name, dims in _dims(model):
        lo: list[int] = []
        opt: list[int] = []
        hi: list[int] = []
        for axis, dim in enumerate(dims):
            if dim is not None and axis != 0:
                lo.append(dim)
                opt.append(dim)
                hi.append(dim)
            elif axis == 0:
                if dim is not None:
                    # A fixed batch axis: the model only takes that batch size.
                    lo.append(dim)
                    opt.append(dim)
                    hi.append(dim)
                else:
                    lo.append(sizes[0])
                    opt.append(sizes[-1])
                    hi.append(sizes[-1])
            else:
                spatial = _spatial(dims, axis, default_hw)
                if spatial is None:
                    raise ValueError(
                        f"input {name!r} axis {axis} is dynamic and not the batch axis:"
                        " pass default_hw=(H, W) to fix image sizes"
                    )
                lo.append(spatial)
                opt.append(spatial)
                hi.append(spatial)
        profiles.append(InputProfile(name, tuple(lo), tuple(opt), tuple(hi)))
    return profiles


def _spatial(dims: list[int | None], axis: int, hw: tuple[int, int] | None) -> int | None:
    """H or W for a dynamic axis of a 4-D image input (NHWC: axes 1, 2; NCHW: 2, 3)."""
    if hw is None or len(dims) != 4:
        return None
    nhwc = dims[3] == 3
    h_axis, w_axis = (1, 2) if nhwc else (2, 3)
    if axis == h_axis:
        return hw[0]
    if axis == w_axis:
        return hw[1]
    return None


def format_shapes(profiles: Sequence[InputProfile], which: str) -> str:
    """ORT's syntax: ``input1:1x3x224x224,input2:...``."""
    return ",".join(f"{p.name}:" + "x".join(str(d) for d in getattr(p, which)) for p in profiles)


def tensorrt_provider_options(
    model: Any,
    batch_sizes: Sequence[int],
    *,
    cache_dir: Path | None = None,
    fp16: bool = True,
    int8: bool = False,
    default_hw: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """ONNX Runtime TensorRT provider options: profiles, engine cache, FP16/INT8.

    INT8 comes from the QDQ model's own scales (``trt_int8_use_native_calibration_table``
    off, no calibration table): TensorRT reads the Q/DQ nodes as explicit quantization.
    """
    profiles = profile_shapes(model, batch_sizes, default_hw=default_hw)
    options: dict[str, Any] = {
        "trt_fp16_enable": bool(fp16),
        "trt_int8_enable": bool(int8),
        "trt_profile_min_shapes": format_shapes(profiles, "min"),
        "trt_profile_opt_shapes": format_shapes(profiles, "opt"),
        "trt_profile_max_shapes": format_shapes(profiles, "max"),
    }
    if cache_dir is not None:
        # Building an engine takes minutes on a Jetson: cache engines and timings on disk.
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        options.update(
            trt_engine_cache_enable=True,
            trt_engine_cache_path=str(cache_dir),
            trt_timing_cache_enable=True,
            trt_timing_cache_path=str(cache_dir),
        )
    return options
