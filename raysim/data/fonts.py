"""Digit (and capital letter) glyphs from fonts that ship with the Python dependencies only.

System fonts differ between machines; these do not, so a seed gives the same renders on
a laptop and on every cluster node (for the same package versions):

* matplotlib's ``mpl-data/fonts/ttf`` (DejaVu, STIX, Computer Modern), minus symbol fonts
  whose digit code points draw symbols;
* Pillow's embedded FreeType font (``ImageFont.load_default(size=...)``, Aileron);
* the Hershey stroke fonts of the ``hershey-fonts`` package, drawn with a random pen
  width, which gives hand-drawn/engraved styles none of the outline fonts have.

Every candidate must draw ten non-empty, pairwise different digits, which rejects fonts
that map digits to a fallback box. ``character_font_pool(chars)`` applies the same test to any
characters (the ``writers`` dataset draws digits and A-Z); its stroke fonts are only the Hershey
families whose letter slots hold Latin capitals (``LATIN_HERSHEY``): the Cyrillic, Greek and
Gothic fonts draw their own alphabets or blackletter there, which no one writes by hand.
"""

from __future__ import annotations

import functools
import io
import tarfile
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from raysim.data.sources import package_file

# digit code points draw symbols or nothing in these (references/data.md section 1.3)
EXCLUDED_TTF_PREFIXES = ("cmex10", "cmsy10", "LastResortHE", "STIXSiz", "STIXNonUni")
EXCLUDED_HERSHEY = ("japanese", "markers", "symbolic")
DIGITS = "0123456789"
UPPERCASE = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Hershey families whose A-Z slots draw Latin capitals (checked by eye against a rendered sheet)
LATIN_HERSHEY = ("cursive", "futural", "futuram", "rowmand", "rowmans", "rowmant", "scriptc", "scripts",
                 "timesi", "timesib", "timesr", "timesrb")


def _crop(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask > 8)
    if ys.size == 0:
        return np.zeros((0, 0), np.float32)
    return mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1].astype(np.float32) / 255.0


@dataclass(eq=False)
class OutlineFont:
    """A FreeType font (file path, or None for Pillow's embedded default)."""

    name: str
    path: str | None
    _sizes: dict = field(default_factory=dict, repr=False)

    kind = "outline"

    def _font(self, px: int):
        f = self._sizes.get(px)
        if f is None:
            f = ImageFont.load_default(size=px) if self.path is None else ImageFont.truetype(self.path, px)
            self._sizes[px] = f
        return f

    def glyph(self, ch: str, px: int, pen: float = 0.0) -> np.ndarray:
        """Tight float mask in [0, 1] of ``ch`` at ``px`` pixels per em (``pen`` unused)."""
        f = self._font(px)
        x0, y0, x1, y1 = f.getbbox(ch)
        im = Image.new("L", (max(1, x1 - x0) + 4, max(1, y1 - y0) + 4), 0)
        ImageDraw.Draw(im).text((2 - x0, 2 - y0), ch, font=f, fill=255)
        return _crop(np.asarray(im))


@dataclass(eq=False)
class StrokeFont:
    """A Hershey stroke font; glyph height follows outline digits (~0.72 em)."""

    name: str
    strokes: dict  # char -> list of polylines [(x, y), ...] in font units, y down

    kind = "stroke"
    SUPERSAMPLE = 4
    # Hershey digits run from the cap line (-12) to the base line (9): 21 units
    UNITS = 21.0

    def glyph(self, ch: str, px: int, pen: float = 0.09) -> np.ndarray:
        """Tight mask of ``ch``; ``pen`` is the stroke width as a fraction of ``px``."""
        s = max(1, -(-self.SUPERSAMPLE * 32 // px))  # ~4x at 32 px, 2x at the 64 px reference
        scale = 0.72 * px / self.UNITS * s
        width = max(1, int(round(pen * px * s)))
        lines = [np.asarray(st, np.float64) * scale for st in self.strokes[ch]]
        allp = np.concatenate(lines)
        lo = allp.min(0) - width
        size = np.ceil(allp.max(0) - lo + width).astype(int) + 1
        size = size + (-size) % s
        im = Image.new("L", (int(size[0]), int(size[1])), 0)
        d = ImageDraw.Draw(im)
        r = width / 2
        for line in lines:
            pts = [tuple(p) for p in (line - lo)]
            if len(pts) > 1:
                d.line(pts, fill=255, width=width)
            for x, y in pts:  # a round pen: round caps and joins (cheaper than joint="curve")
                d.ellipse((x - r, y - r, x + r, y + r), fill=255)
        im = im.resize((im.width // s, im.height // s), Image.BOX)
        return _crop(np.asarray(im))


def _digits_ok(font, chars: str = DIGITS) -> bool:
    """``font`` draws every one of ``chars``, non-empty and pairwise different."""
    try:
        masks = [font.glyph(d, 24) for d in chars]
    except Exception:  # a font that cannot draw a character is simply not used
        return False
    if any(m.size == 0 for m in masks):
        return False
    sigs = {(m.shape, np.round(m, 2).tobytes()) for m in masks}
    return len(sigs) == len(masks)


def _hershey_fonts(chars: str = DIGITS, only: tuple[str, ...] | None = None) -> list[StrokeFont]:
    """The Hershey fonts (all but EXCLUDED_HERSHEY, or just those named in ``only``) that hold a
    non-empty glyph for every one of ``chars``, in name order."""
    from HersheyFonts import HersheyFonts

    h = HersheyFonts()
    try:  # open the embedded archive once; load_default_font() re-opens it per font (~30 ms)
        tar = tarfile.open(fileobj=io.BytesIO(h._HersheyFonts__get_compressed_font_bytes()))
    except (AttributeError, tarfile.TarError):
        tar = None
    out = []
    for name in sorted(h.default_font_names):
        if name in EXCLUDED_HERSHEY or (only is not None and name not in only):
            continue
        if tar is not None:
            h.read_from_string_lines(tar.extractfile(name))
        else:
            h.load_default_font(name)
        strokes = {}
        for d in chars:
            glyphs = list(h.glyphs_for_text(d))
            if not glyphs:
                break
            g = glyphs[0]
            # raw Hershey coordinates are y-down (cap line -12 above base line 9), i.e. image
            # coordinates; normalize_rendering() would negate y for y-up plotting.
            polys = [[(x - g.left_offset, y) for x, y in st] for st in g.strokes if len(st)]
            if not polys:
                break
            strokes[d] = polys
        if len(strokes) == len(chars):
            out.append(StrokeFont(f"hershey:{name}", strokes))
    return out


REFERENCE_PX = 64


@functools.lru_cache(maxsize=None)
def _reference(font, ch: str, pen: float) -> Image.Image:
    return Image.fromarray((font.glyph(ch, REFERENCE_PX, pen) * 255 + 0.5).astype(np.uint8), "L")


@functools.lru_cache(maxsize=65536)
def scaled_glyph(font, ch: str, px: int, pen: float = 0.0) -> np.ndarray:
    """``font``'s glyph (uint8 mask, tight box) rendered once at REFERENCE_PX and
    downscaled with antialiasing to ``px`` per em.

    One rendering per (font, char, pen) instead of one per size keeps generation fast and
    makes every size a faithful scaled copy. Cached and shared: do not modify it.
    """
    ref = _reference(font, ch, pen)
    s = px / REFERENCE_PX
    m = np.asarray(ref.resize((max(1, round(ref.width * s)), max(1, round(ref.height * s))), Image.BILINEAR))
    m.setflags(write=False)
    return m


def _outline_fonts() -> list[OutlineFont]:
    """Fresh font objects for matplotlib's TTFs (symbol fonts excluded), then Pillow's default."""
    ttf_dir = package_file("matplotlib", "mpl-data", "fonts", "ttf")
    outline = [
        OutlineFont(f"mpl:{p.stem}", str(p))
        for p in sorted(ttf_dir.glob("*.ttf"))
        if not p.stem.startswith(EXCLUDED_TTF_PREFIXES)
    ]
    outline.append(OutlineFont("pillow:default", None))
    return outline


@functools.lru_cache(maxsize=1)
def font_pool() -> tuple[tuple, tuple]:
    """(outline fonts, stroke fonts), each in a fixed order, all passing the digit check."""
    outline = _outline_fonts()
    outline = [f for f in outline if _digits_ok(f)]
    stroke = [f for f in _hershey_fonts() if _digits_ok(f)]
    return tuple(outline), tuple(stroke)


@functools.lru_cache(maxsize=None)
def character_font_pool(chars: str = DIGITS + UPPERCASE) -> tuple[tuple, tuple]:
    """(outline fonts, stroke fonts) that each draw all of ``chars``, in a fixed order.

    New font objects (not font_pool()'s): a stroke font here holds strokes for ``chars``, and
    digits5's glyph caches, keyed by font object, stay exactly as they were.
    """
    outline = _outline_fonts()
    outline = [f for f in outline if _digits_ok(f, chars)]
    stroke = [f for f in _hershey_fonts(chars, only=LATIN_HERSHEY) if _digits_ok(f, chars)]
    return tuple(outline), tuple(stroke)
