"""``edgeloop models build-engine``: a native TensorRT engine for Jetson deployment.

Profiles come from the model's dynamic axes and the batch sizes (``kernels.tensorrt``),
the same derivation ONNX Runtime's TensorRT provider gets. Mount with
``register_engine_command(models_app)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kernels.tensorrt import profile_shapes

__all__ = ["build_engine", "parse_batches", "register_engine_command"]

EXIT_UNAVAILABLE = 2


class EngineBuildError(RuntimeError):
    """The engine could not be built (TensorRT missing, parse or build failure)."""


def parse_batches(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--batch takes comma-separated integers, got {text!r}") from exc
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"--batch takes positive integers, got {text!r}")
    return sizes


def build_engine(
    model: Path, out: Path, batches: list[int], *, fp16: bool = False, int8: bool = False
) -> Path:
    """Parse ``model`` with TensorRT, add one profile for every input, serialize to ``out``."""
    try:
        import tensorrt as trt  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise EngineBuildError(
            "the tensorrt Python package is not installed: install the `gpu` extra on a"
            " machine with an NVIDIA GPU (JetPack ships it on a Jetson)"
        ) from exc
    profiles = profile_shapes(model, batches)
    logger = trt.Logger(trt.Logger.WARNING)
    builder: Any = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT cannot parse {model}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if int8:  # explicit quantization: the QDQ model carries its own scales
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    for p in profiles:
        profile.set_shape(p.name, p.min, p.opt, p.max)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT failed to build an engine for {model}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(serialized))
    return out


def register_engine_command(models_app: typer.Typer) -> None:
    """Add ``build-engine`` to the ``models`` command group."""

    @models_app.command("build-engine")
    def build_engine_command(
        model: Annotated[Path, typer.Argument(help="ONNX model (FP32, or INT8 QDQ)")],
        out: Annotated[Path, typer.Option("--out", help="where to write the .engine/.plan")],
        batch: Annotated[str, typer.Option(help="batch sizes the profile covers")] = "1,8,32",
        fp16: Annotated[bool, typer.Option("--fp16", help="allow FP16 kernels")] = False,
        int8: Annotated[bool, typer.Option("--int8", help="INT8 from the QDQ scales")] = False,
    ) -> None:
        """Build a native TensorRT engine with profiles from the model's dynamic axes."""
        if not model.is_file():
            typer.echo(f"error: {model} does not exist", err=True)
            raise typer.Exit(EXIT_UNAVAILABLE)
        batches = parse_batches(batch)
        try:
            path = build_engine(model, out, batches, fp16=fp16, int8=int8)
        except (EngineBuildError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_UNAVAILABLE) from exc
        typer.echo(f"engine written to {path} (batch sizes {batches})")
