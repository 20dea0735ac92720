"""Distribution shift on camera frames: named, parameterised drifts with a severity in [0, 1].

A drift models something that changes on a real line after the model shipped: the
lights, the sensor, focus, camera mount, compression settings, the belt itself.
Each kind maps a severity to a concrete effect (``DRIFT_KINDS`` documents the scale
at severity 1.0); severity 0 leaves a frame untouched. Drifts never move the
object out of the frame or change what it is, so labels are kept.

A ``DriftSpec`` is a tuple of ``Drift`` values, written ``"noise:1.0,rotation:0.5"``.
However a spec is written, its drifts are applied in the physical order of the
imaging chain (``DRIFT_ORDER``): scene (background), pose (rotation), light, optics
(blur), sensor (noise), encoder (jpeg).

Randomness: every random draw of a drift is made before its severity is used, and
the generator is derived from (seed, frame index), so the same frame at a higher
severity is the same effect made stronger. That is what makes severity sweeps and
the stream's gradual ramps smooth.

``FrameStream`` replays a frame pool as a camera would, with a drift switched on
abruptly or ramped in gradually, at an optional frame rate.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image
from scipy import ndimage

from distill.frames import FrameSet
from distill.scenario import alternate_background

__all__ = [
    "DRIFT_KINDS",
    "DRIFT_NAMES",
    "DRIFT_ORDER",
    "Drift",
    "DriftKind",
    "DriftSchedule",
    "DriftSpec",
    "DriftSpecError",
    "FrameStream",
    "StreamFrame",
    "apply_drift",
    "apply_drift_frame",
    "format_drift_spec",
    "parse_drift_spec",
    "parse_drift_specs",
    "random_drift_spec",
]


class DriftSpecError(ValueError):
    """A drift spec string or value that cannot be accepted."""


_DriftFn = Callable[[np.ndarray, float, np.random.Generator, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class DriftKind:
    """One family of shift: what severity 1.0 means, and the function that applies it."""

    name: str
    description: str
    apply: _DriftFn  # (frame float32 [H, W, 3] 0..255, severity, rng, mask) -> frame


# ---------------------------------------------------------------------------------
# The scale of each drift at severity 1.0 (pixel sizes for 64 px frames, scaled with
# the frame). Tuned together with the models: at 1.0 each drift must cost the
# clean-trained student at least 15 points of top-1 while the drift-augmented
# teacher keeps 93% or more (measured in bench/models.py). Changing one changes the
# teacher's training data: bump distill.cache.CODE_VERSION.

_BACKGROUND_TREAD = 0.25  # relative brightness swing of the new belt's tread
_BACKGROUND_SCUFF_OPACITY = 0.4
_ROTATION_MAX_DEGREES = 30.0
_LIGHTING_CONTRAST_LOSS = 0.7  # contrast falls to 1 - this
_LIGHTING_DIM = 0.4  # mean brightness falls by this
_LIGHTING_GRADIENT = 0.8  # +- brightness swing across the frame
_LIGHTING_CAST = 0.25  # colour cast (relative per-channel gain)
_BLUR_MOTION_PX = 14.0
_BLUR_DEFOCUS_SIGMA_PX = 1.6
_NOISE_SIGMA = 55.0  # of 255
_NOISE_IMPULSE = 0.04  # fraction of hot/dead pixels
_JPEG_QUALITY_CLEAN = 95
_JPEG_QUALITY_WORST = 3

# ---------------------------------------------------------------------------------
# The drift functions. Each takes float32 pixels in 0..255 and returns the same;
# random draws come first, severity scales them afterwards (see module docstring).


def _background(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    alt = alternate_background(
        rng, frame.shape[0], tread=_BACKGROUND_TREAD, scuff_opacity=_BACKGROUND_SCUFF_OPACITY
    )
    if mask is None:
        # Without a mask the object cannot be kept in front, so the new texture shows
        # through everywhere at half strength.
        return frame * (1.0 - 0.5 * s) + alt * (0.5 * s)
    visible = (1.0 - mask)[..., None] * s  # where the belt shows, scaled by severity
    return frame * (1.0 - visible) + alt * visible


def _rotation(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    sign = float(rng.choice([-1.0, 1.0]))
    angle = sign * s * _ROTATION_MAX_DEGREES
    if angle == 0.0:
        return frame
    # Rotate about the object (its ink centroid) when known so it stays in view.
    # Corners that come from outside the old field of view are filled with the
    # frame's median border colour: reflecting would mirror an object near the edge
    # into a second, partial copy.
    if mask is not None and mask.sum() > 0:
        cy, cx = ndimage.center_of_mass(mask)
    else:
        cy = cx = (frame.shape[0] - 1) / 2.0
    theta = math.radians(angle)
    rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    center = np.array([cy, cx])
    offset = center - rot @ center
    border = np.concatenate([frame[0], frame[-1], frame[:, 0], frame[:, -1]])
    fill = np.median(border, axis=0)
    out = np.empty_like(frame)
    for c in range(3):
        out[..., c] = ndimage.affine_transform(
            frame[..., c], rot, offset=offset, order=1, mode="constant", cval=float(fill[c])
        )
    return out


def _lighting(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    size = frame.shape[0]
    direction = rng.uniform(0.0, 2.0 * math.pi)
    cast = rng.normal(0.0, 1.0, 3).astype(np.float32)
    cast /= max(float(np.linalg.norm(cast)), 1e-6)
    # A failing lamp: contrast collapses, the frame dims towards one side, and the
    # light takes on a colour.
    contrast = 1.0 - _LIGHTING_CONTRAST_LOSS * s
    mean = frame.mean(axis=(0, 1), keepdims=True)
    out = mean + (frame - mean) * contrast
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1) - 0.5
    ramp = xx * math.cos(direction) + yy * math.sin(direction)  # -0.7..0.7
    gain = (1.0 - _LIGHTING_DIM * s) * (1.0 + _LIGHTING_GRADIENT * s * ramp)
    out = out * gain[..., None] * (1.0 + _LIGHTING_CAST * s * cast)[None, None, :]
    return out


def _blur(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    if s <= 0.0:
        return frame
    size = frame.shape[0]
    k = size / 64.0
    # Motion blur along the belt (the shutter is too slow for the line speed), plus
    # defocus. Lengths in pixels at 64 px frames, scaled with the frame.
    length = 1.0 + s * _BLUR_MOTION_PX * k
    sigma = s * _BLUR_DEFOCUS_SIGMA_PX * k
    taps = max(1, math.ceil(length))
    weights = np.ones(taps, dtype=np.float32)
    weights[-1] = length - (taps - 1)  # fractional last tap keeps blur continuous in s
    weights /= weights.sum()
    out = ndimage.convolve1d(frame, weights, axis=1, mode="reflect")
    if sigma > 0.0:
        out = ndimage.gaussian_filter(out, sigma=(sigma, sigma, 0), mode="reflect")
    return out


def _noise(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    # Sensor noise in a dark, high-gain setting: strong per-channel Gaussian noise
    # plus a sprinkle of hot/dead pixels.
    gauss = rng.standard_normal(frame.shape).astype(np.float32)
    speckle = rng.uniform(0.0, 1.0, frame.shape[:2]).astype(np.float32)
    hot = rng.choice([0.0, 255.0], size=frame.shape[:2]).astype(np.float32)
    out = frame + gauss * (s * _NOISE_SIGMA)
    impulse = speckle < s * _NOISE_IMPULSE
    out[impulse] = hot[impulse][:, None]
    return out


def _jpeg(
    frame: np.ndarray, s: float, rng: np.random.Generator, mask: np.ndarray | None
) -> np.ndarray:
    if s <= 0.0:
        return frame
    # An overloaded uplink pushed the encoder's quality down; past half severity it
    # also subsamples chroma (4:2:0), as constrained encoders do. Quality falls
    # geometrically (95, 40, 17, 7, 3 at 0, .25, .5, .75, 1): JPEG damage grows
    # mostly in the last few quality steps, so a linear ramp would sit flat and
    # then fall off a cliff.
    quality = round(_JPEG_QUALITY_CLEAN * (_JPEG_QUALITY_WORST / _JPEG_QUALITY_CLEAN) ** s)
    img = Image.fromarray(np.clip(np.rint(frame), 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, subsampling=2 if s > 0.5 else 0)
    buf.seek(0)
    with Image.open(buf) as decoded:
        return np.asarray(decoded.convert("RGB"), dtype=np.float32)


DRIFT_KINDS: dict[str, DriftKind] = {
    k.name: k
    for k in (
        DriftKind(
            "background",
            "the belt is replaced: at 1.0 a high-contrast diagonal tread with dark,"
            " stroke-like scuffs shows wherever the object does not",
            _background,
        ),
        DriftKind(
            "rotation",
            f"the camera mount twists: up to {_ROTATION_MAX_DEGREES:g} degrees at 1.0,"
            " either direction",
            _rotation,
        ),
        DriftKind(
            "lighting",
            f"a failing lamp: at 1.0 contrast falls to {100 * (1 - _LIGHTING_CONTRAST_LOSS):.0f}%,"
            f" the frame dims by {100 * _LIGHTING_DIM:.0f}% with a"
            f" +-{100 * _LIGHTING_GRADIENT:.0f}% gradient across it and a colour cast",
            _lighting,
        ),
        DriftKind(
            "blur",
            f"slow shutter and lost focus: at 1.0 a {1 + _BLUR_MOTION_PX:g} px motion blur"
            f" along the belt plus a {_BLUR_DEFOCUS_SIGMA_PX:g} px Gaussian (64 px frames)",
            _blur,
        ),
        DriftKind(
            "noise",
            f"high sensor gain: at 1.0 Gaussian noise of sigma {_NOISE_SIGMA:g} (of 255) per"
            f" channel and {100 * _NOISE_IMPULSE:g}% hot/dead pixels",
            _noise,
        ),
        DriftKind(
            "jpeg",
            f"encoder squeezed: JPEG quality {_JPEG_QUALITY_CLEAN} falling geometrically to"
            f" {_JPEG_QUALITY_WORST} at 1.0 (17 at 0.5), 4:2:0 chroma subsampling above 0.5",
            _jpeg,
        ),
    )
}
DRIFT_ORDER: tuple[str, ...] = ("background", "rotation", "lighting", "blur", "noise", "jpeg")
DRIFT_NAMES: tuple[str, ...] = DRIFT_ORDER
assert set(DRIFT_ORDER) == set(DRIFT_KINDS)


# ---------------------------------------------------------------------------------
# Specs


@dataclass(frozen=True, order=True)
class Drift:
    """One drift kind at a severity in [0, 1]."""

    name: str
    severity: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in DRIFT_KINDS:
            raise DriftSpecError(
                f"unknown drift {self.name!r}; known drifts: {', '.join(DRIFT_NAMES)}"
            )
        sev = float(self.severity)
        if not (0.0 <= sev <= 1.0) or math.isnan(sev):
            raise DriftSpecError(
                f"severity of drift {self.name!r} must be in [0, 1], got {self.severity!r}"
            )
        object.__setattr__(self, "severity", sev)

    def __str__(self) -> str:
        return f"{self.name}:{self.severity:g}"

    def scaled(self, factor: float) -> Drift:
        return Drift(self.name, min(1.0, max(0.0, self.severity * factor)))


DriftSpec = tuple[Drift, ...]


def _canonical(drifts: Iterable[Drift]) -> DriftSpec:
    seen: dict[str, Drift] = {}
    for d in drifts:
        if d.name in seen:
            raise DriftSpecError(f"drift {d.name!r} given twice; give each drift once")
        seen[d.name] = d
    return tuple(seen[name] for name in DRIFT_ORDER if name in seen)


def parse_drift_spec(text: str) -> DriftSpec:
    """Parse ``"blur:0.8"`` or ``"noise:1.0,rotation:0.5"``; ``""``/``"none"`` is no drift."""
    text = text.strip()
    if text.lower() in ("", "none", "clean"):
        return ()
    drifts = []
    for part in text.split(","):
        part = part.strip()
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or not name or not value.strip():
            raise DriftSpecError(
                f"bad drift {part!r}: expected NAME:SEVERITY, e.g. 'blur:0.8'"
                f" (drifts: {', '.join(DRIFT_NAMES)})"
            )
        try:
            severity = float(value)
        except ValueError:
            raise DriftSpecError(
                f"bad severity {value.strip()!r} in {part!r}: expected a number in [0, 1]"
            ) from None
        drifts.append(Drift(name, severity))
    return _canonical(drifts)


def parse_drift_specs(texts: Iterable[str]) -> DriftSpec:
    """Several spec strings (e.g. repeated ``--drift`` options) composed into one spec."""
    return _canonical(d for t in texts for d in parse_drift_spec(t))


def format_drift_spec(spec: Sequence[Drift]) -> str:
    return ",".join(str(d) for d in spec) if spec else "none"


def random_drift_spec(
    rng: np.random.Generator, *, p_clean: float = 0.3, max_drifts: int = 2
) -> DriftSpec:
    """A random mix for training-time augmentation: clean sometimes, else 1..max drifts."""
    if rng.uniform() < p_clean:
        return ()
    count = int(rng.integers(1, max_drifts + 1))
    names = rng.choice(len(DRIFT_NAMES), size=count, replace=False)
    return _canonical(Drift(DRIFT_NAMES[i], float(rng.uniform(0.2, 1.0))) for i in names)


# ---------------------------------------------------------------------------------
# Applying


def apply_drift_frame(
    frame: np.ndarray,
    spec: Sequence[Drift],
    rng_seed: Sequence[int] | int,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """One uint8 [H, W, 3] frame through the spec; returns a new uint8 frame."""
    if not spec:
        return frame.copy()
    out = frame.astype(np.float32)
    seed = [rng_seed] if isinstance(rng_seed, int) else list(rng_seed)
    for drift in _canonical(spec):
        # Each kind has its own generator so adding one drift to a spec does not
        # change what another does.
        rng = np.random.default_rng([*seed, DRIFT_ORDER.index(drift.name)])
        out = DRIFT_KINDS[drift.name].apply(out, drift.severity, rng, mask)
        out = np.clip(out, 0.0, 255.0)
    return np.rint(out).astype(np.uint8)


def apply_drift(
    frames: FrameSet | np.ndarray, spec: Sequence[Drift], *, seed: int = 0
) -> np.ndarray:
    """All frames through the spec; frame i uses generator (seed, i). Returns uint8 NHWC.

    With an empty spec the input pixels themselves are returned, not a copy.
    """
    if isinstance(frames, FrameSet):
        pixels, masks = frames.frames, frames.masks
    else:
        pixels, masks = frames, None
    if not spec:
        return pixels
    out = np.empty_like(pixels)
    for i in range(len(pixels)):
        out[i] = apply_drift_frame(pixels[i], spec, (seed, i), None if masks is None else masks[i])
    return out


# ---------------------------------------------------------------------------------
# Streams


@dataclass(frozen=True)
class DriftSchedule:
    """When a drift takes hold in a stream.

    ``abrupt``: full severity from frame ``start`` on. ``gradual``: severity ramps
    linearly from 0 at ``start`` to full at ``start + length``. ``none``: never.
    """

    kind: Literal["abrupt", "gradual", "none"] = "abrupt"
    start: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("abrupt", "gradual", "none"):
            raise DriftSpecError(f"unknown schedule {self.kind!r}; use abrupt, gradual or none")
        if self.start < 0 or self.length < 0:
            raise DriftSpecError("schedule start and length must be >= 0")
        if self.kind == "gradual" and self.length == 0:
            raise DriftSpecError("a gradual schedule needs a ramp length > 0")

    def factor(self, index: int) -> float:
        """Fraction of the spec's severity in force at frame ``index``."""
        if self.kind == "none" or index < self.start:
            return 0.0
        if self.kind == "abrupt":
            return 1.0
        return min(1.0, (index - self.start) / self.length)


@dataclass(frozen=True)
class StreamFrame:
    index: int
    frame: np.ndarray  # uint8 [H, W, 3]
    label: int
    class_name: str
    drift: dict[str, float]  # severity in force per drift name (0.0 when not yet)
    timestamp: float  # seconds on the stream's clock


class FrameStream:
    """Frames from a pool in shuffled passes, drifted per a schedule, optionally paced.

    ``rate`` (frames per second) paces the stream with ``sleep``; ``None`` yields as
    fast as the consumer takes them (tests). ``limit`` stops after that many frames;
    otherwise the stream runs forever, reshuffling the pool on each pass.
    ``clock`` and ``sleep`` are seams for tests.
    """

    def __init__(
        self,
        pool: FrameSet,
        *,
        drift: Sequence[Drift] = (),
        schedule: DriftSchedule = DriftSchedule("abrupt", 0),
        rate: float | None = None,
        seed: int = 0,
        limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if len(pool) == 0:
            raise DriftSpecError("a frame stream needs a non-empty pool")
        if rate is not None and rate <= 0:
            raise DriftSpecError(f"rate must be > 0 frames/s, got {rate}")
        self.pool = pool
        self.spec = _canonical(drift)
        self.schedule = schedule
        self.rate = rate
        self.seed = seed
        self.limit = limit
        self._clock = clock
        self._sleep = sleep

    def severity_at(self, index: int) -> dict[str, float]:
        factor = self.schedule.factor(index)
        return {d.name: d.severity * factor for d in self.spec}

    def __iter__(self) -> Iterator[StreamFrame]:
        rng = np.random.default_rng([self.seed, 104729])
        order = rng.permutation(len(self.pool))
        start = self._clock()
        index = 0
        while self.limit is None or index < self.limit:
            pos = index % len(order)
            if pos == 0 and index > 0:
                order = rng.permutation(len(self.pool))
            item = int(order[pos])
            if self.rate is not None:
                due = start + index / self.rate
                wait = due - self._clock()
                if wait > 0:
                    self._sleep(wait)
            state = self.severity_at(index)
            spec = tuple(Drift(n, s) for n, s in state.items() if s > 0.0)
            mask = None if self.pool.masks is None else self.pool.masks[item]
            frame = apply_drift_frame(self.pool.frames[item], spec, (self.seed, index), mask)
            label = int(self.pool.labels[item])
            yield StreamFrame(
                index=index,
                frame=frame,
                label=label,
                class_name=self.pool.class_names[label],
                drift=state,
                timestamp=self._clock() - start,
            )
            index += 1
