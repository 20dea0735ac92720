"""``edgeloop models import``: wrap a pre-trained ONNX classifier onto the model contract.

A model that cannot work is refused with one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import shutil
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from distill.model_import import ImportSpec, card_path_for, import_onnx, read_labels
from shared.errors import DataError, EdgeLoopError
from simulations.cli_models import install_model

__all__ = ["register_import_command"]


class _Role(StrEnum):
    teacher = "teacher"
    student = "student"


class _Layout(StrEnum):
    NCHW = "NCHW"
    NHWC = "NHWC"


class _Dtype(StrEnum):
    float32 = "float32"
    uint8 = "uint8"


class _Outputs(StrEnum):
    logits = "logits"
    probabilities = "probabilities"


def _triple(text: str, what: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise DataError(f"--{what} takes three numbers R,G,B, like 0.485,0.456,0.406") from None
    if len(values) != 3:
        raise DataError(f"--{what} takes three numbers R,G,B, got {len(values)}")
    return (values[0], values[1], values[2])


def _default_scale(dtype: str) -> float:
    return 1 / 255 if dtype == "float32" else 1.0


def _size(text: str | None) -> tuple[int, int] | None:
    """``WxH`` as (height, width)."""
    if text is None:
        return None
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise DataError(f"--size takes WIDTHxHEIGHT, like 224x224, not {text!r}") from None
    return (height, width)


def _install(path: Path, role: str) -> Path:
    """Put the model (and its card) where ``role``'s process loads it by default."""
    target = install_model(path, role)
    shutil.copyfile(card_path_for(path), card_path_for(target))
    return target


def register_import_command(models_app: typer.Typer) -> None:
    """Add ``import`` to the ``models`` command group."""

    @models_app.command("import")
    def import_command(
        model: Annotated[Path, typer.Argument(help="the pre-trained ONNX classifier")],
        role: Annotated[_Role, typer.Option("--role", help="teacher (verifier) or student")],
        labels: Annotated[
            Path, typer.Option("--labels", help="class names: one a line, or a JSON list")
        ],
        input_name: Annotated[str, typer.Option("--input", help="the model's input tensor")],
        layout: Annotated[_Layout, typer.Option("--layout", help="the input's layout")] = (
            _Layout.NCHW
        ),
        dtype: Annotated[_Dtype, typer.Option("--dtype", help="the input's type")] = (
            _Dtype.float32
        ),
        size: Annotated[
            str | None,
            typer.Option("--size", help="WIDTHxHEIGHT; needed when the model's are dynamic"),
        ] = None,
        mean: Annotated[
            str, typer.Option("--mean", help="per channel R,G,B: (pixel * scale - mean) / std")
        ] = "0,0,0",
        std: Annotated[str, typer.Option("--std", help="per channel R,G,B")] = "1,1,1",
        scale: Annotated[
            float | None,
            typer.Option(
                "--scale",
                help="pixel (0-255) multiplier; default 1/255 for float32 (pixels in 0..1, as"
                " torchvision's mean/std expect), 1 for uint8; --scale 1 for 0..255 floats",
            ),
        ] = None,
        output: Annotated[
            str | None, typer.Option("--output", help="the scores output (default: the only one)")
        ] = None,
        outputs: Annotated[
            _Outputs | None,
            typer.Option(
                "--outputs", help="what it returns (default: probabilities after a Softmax)"
            ),
        ] = None,
        name: Annotated[str | None, typer.Option("--name", help="model name")] = None,
        version: Annotated[str | None, typer.Option("--version", help="model version")] = None,
        out: Annotated[
            Path | None, typer.Option("--out", help="where to write (default: NAME-edgeloop.onnx)")
        ] = None,
        install: Annotated[
            bool,
            typer.Option("--install", help="also put it where ROLE's process loads it"),
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    ) -> None:
        """Wrap a float32 or uint8, NCHW or NHWC classifier so the agent and verifier serve it.

        The new model takes uint8 RGB camera frames (NHWC, any batch) and returns class
        probabilities; the preprocessing given here runs in its graph. A model card
        (NAME.card.json) is written beside it.
        """
        try:
            spec = ImportSpec(
                role=role.value,
                labels=read_labels(labels),
                input_name=input_name,
                layout=layout.value,
                dtype=dtype.value,
                size=_size(size),
                mean=_triple(mean, "mean"),
                std=_triple(std, "std"),
                scale=scale if scale is not None else _default_scale(dtype.value),
                output_name=output,
                outputs=outputs.value if outputs else None,
                name=name,
                version=version,
            )
            target = out or model.with_name(f"{model.stem}-edgeloop.onnx")
            result = import_onnx(model, spec, out=target)
            installed = _install(result.path, spec.role) if install else None
        except EdgeLoopError as exc:
            typer.echo(f"error: {' '.join(exc.message.split())}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            report = {**result.to_dict(), "installed": str(installed) if installed else None}
            typer.echo(json.dumps(report, indent=2, sort_keys=True))
            return
        h, w = result.card.input.shape[1], result.card.input.shape[2]
        typer.echo(
            f"imported {result.card.name} {result.card.version} ({result.card.role}):"
            f" frames uint8 [batch, {h}, {w}, 3] -> scores [batch, {len(result.card.labels)}]"
        )
        typer.echo(f"  model  {result.path}")
        typer.echo(f"  card   {result.card_path}")
        typer.echo(f"  parity max |diff| {result.max_abs_diff:.2e} against the original")
        if installed is not None:
            typer.echo(f"  installed as {installed}")
