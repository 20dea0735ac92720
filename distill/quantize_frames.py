"""The frames a quantization run calibrates on, selects settings with and reports on."""

from __future__ import annotations

from dataclasses import dataclass

from distill.datasets import DIGITS, LoadedData, load_data
from shared.errors import DataError

__all__ = ["QuantFrames", "quantization_frames"]


@dataclass(frozen=True)
class QuantFrames:
    """The frames a quantization run uses, each set for one purpose: ``calibration`` sets
    the activation ranges, ``selection`` compares settings (``auto``), and ``held_out``
    is what the reported accuracy is measured on; never a calibration frame."""

    calibration: LoadedData
    selection: LoadedData
    held_out: LoadedData

    @property
    def note(self) -> str:
        """Which frames were used, for the report."""
        h, c = self.held_out, self.calibration
        return (
            f"{h.split} split of {h.source} ({len(h.frames)} frames, held out;"
            f" calibrated on its {c.split} split, {len(c.frames)} frames)"
        )


def _split_or_none(source: str, split: str, frame_size: int, format: str) -> LoadedData | None:
    try:
        return load_data(source, split=split, frame_size=frame_size, format=format)
    except DataError as exc:
        if "no readable images in split" in exc.message:
            return None
        raise


def quantization_frames(source: str, *, frame_size: int, format: str = "auto") -> QuantFrames:
    """Calibration, selection and held-out frames from ``digits`` or a labelled dataset.

    ``digits``: the stream split calibrates, validation selects, test is held out. A
    dataset: its train split calibrates (validation when it has no train split), and
    accuracy is reported on its test split (else its validation split), which
    ``edgeloop models train`` never trained on either.
    """
    if str(source) == DIGITS:
        return QuantFrames(
            calibration=load_data(DIGITS, split="stream", frame_size=frame_size),
            selection=load_data(DIGITS, split="validation", frame_size=frame_size),
            held_out=load_data(DIGITS, split="test", frame_size=frame_size),
        )
    parts = {
        s: _split_or_none(source, s, frame_size, format) for s in ("train", "validation", "test")
    }
    calibration = parts["train"] or parts["validation"]
    rest = [
        d for d in (parts["test"], parts["validation"]) if d is not None and d is not calibration
    ]
    if calibration is None or not rest:
        have = ", ".join(f"{s} {0 if d is None else len(d.frames)}" for s, d in parts.items())
        raise DataError(
            f"{source} cannot give both calibration frames and held-out frames to report"
            f" accuracy on (frames per split: {have}); quantize calibrates on the train split"
            " and reports on the test or validation split"
        )
    held_out = rest[0]
    validation = parts["validation"]
    selection = validation if validation is not None and validation is not calibration else held_out
    return QuantFrames(calibration=calibration, selection=selection, held_out=held_out)
