"""The rate card: per-model prices by phase (USD per million tokens) and storage (USD per GB-month).

Shipped defaults live in `rates.toml` next to this module; `$TRINE_HOME/rates.toml` and an explicit
file override them row by row (a row given there replaces the fields it names). Invariants: every price
is a finite number >= 0; `price(model)` always answers (unknown models get the "default" row).
`train_loss` tokens are never billed on their own: they are a subset of the computed `train` tokens.

Full fine-tuning's training tokens (a usage event with `full_fine_tuning`) are priced from a row of
their own: `"<model>:full"`, else `"default:full"`; such a row needs only `train` (its other phases
are never read: sampling a fully trained model is priced by the model's row).
"""

from __future__ import annotations

import math

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from ..home import trine_home
from .events import IMAGE_PHASES
from .money import money

SHIPPED = Path(__file__).with_name("rates.toml")
DEFAULT_ROW = "default"
FULL_SUFFIX = ":full"  # "<model>:full": the row that prices a model's full fine-tuning tokens
# prefill_image(_cached): the vision tokens among prefill(_cached), priced apart (a row that names no
# image price charges them as text: prefill's and prefill_cached's prices); `cost` charges the text
# rows only for the text tokens, so the phases' costs add up to the total
BILLED_PHASES = ("prefill", "prefill_cached", "sample", "train", "prefill_image", "prefill_image_cached")
CACHED_FRACTION = 0.2  # prefill_cached = 0.2 x prefill when a row omits it
_ROW_KEYS = {*BILLED_PHASES, "storage_gb_month", "note"}
_TOP_KEYS = {"currency", "storage_gb_month", "models"}


def model_key(name: str) -> str:
    """How model names are matched: last path component, case-insensitive ("Qwen/Qwen3-8B" -> "qwen3-8b")."""
    return name.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].lower()


@dataclass(frozen=True)
class ModelPrices:
    model: str
    prefill: float  # USD per 1M prompt tokens computed
    prefill_cached: float  # USD per 1M prompt tokens served from the prefix cache
    sample: float  # USD per 1M generated tokens
    train: float  # USD per 1M computed training positions (forward or forward + backward)
    prefill_image: float  # USD per 1M image tokens computed
    prefill_image_cached: float  # USD per 1M image tokens served from the prefix cache
    storage_gb_month: float  # USD per GB-month of checkpoints
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class RateCard:
    """Prices for every model the card names, plus the "default" row for the rest."""

    def __init__(self, rows: dict[str, ModelPrices], currency: str = "USD", sources: tuple[str, ...] = ()):
        if DEFAULT_ROW not in rows:
            raise ValueError(f"a rate card needs a [models.{DEFAULT_ROW}] row for models it does not name")
        self.rows = rows  # model_key -> prices
        self.currency = currency
        self.sources = sources  # files read, in order

    @classmethod
    def load(cls, path: str | Path | None = None, *, home: str | Path | None = None) -> RateCard:
        """The shipped card, then `<home>/rates.toml` (home defaults to $TRINE_HOME) if it exists, then
        `path`."""
        files = [SHIPPED]
        user = Path(home or trine_home()) / "rates.toml"
        if user.is_file():
            files.append(user)
        if path is not None:
            if not Path(path).is_file():
                raise ValueError(f"rate card {path} does not exist: pass an existing TOML file with --rates")
            files.append(Path(path))
        return cls.from_tomls([(str(f), f.read_text()) for f in files])

    @classmethod
    def from_tomls(cls, texts: list[tuple[str, str]]) -> RateCard:
        """Merge TOML texts in order, each a (source name, text) pair; later rows override earlier fields."""
        currency, storage = "USD", None
        raw: dict[str, dict] = {}  # model_key -> merged fields (with "model": display name)
        for source, text in texts:
            try:
                doc = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"rate card {source} is not valid TOML: {e}") from None
            unknown = set(doc) - _TOP_KEYS
            if unknown:
                raise ValueError(
                    f"rate card {source}: unknown top-level key(s) {sorted(unknown)}; "
                    f"allowed: {sorted(_TOP_KEYS)}"
                )
            currency = doc.get("currency", currency)
            if "storage_gb_month" in doc:
                storage = _price(doc["storage_gb_month"], f"{source}: storage_gb_month")
            for name, row in doc.get("models", {}).items():
                if not isinstance(row, dict):
                    raise ValueError(f'rate card {source}: models."{name}" must be a table of prices')
                bad = set(row) - _ROW_KEYS
                if bad:
                    raise ValueError(
                        f'rate card {source}: models."{name}" has unknown field(s) {sorted(bad)}; '
                        f"allowed: {sorted(_ROW_KEYS)}"
                    )
                for k, v in row.items():
                    if k != "note":
                        _price(v, f'{source}: models."{name}".{k}')
                merged = raw.setdefault(model_key(name), {"model": name})
                if "prefill" in row and "prefill_cached" not in row:
                    merged.pop("prefill_cached", None)  # re-derive from the new prefill
                merged.update(row)
        rows = {}
        for key, r in raw.items():
            if key.endswith(FULL_SUFFIX):  # only `train` is read; the rest is 0 unless given
                r = {"prefill": 0.0, "prefill_cached": 0.0, "sample": 0.0, **r}
            missing = [k for k in ("prefill", "sample", "train") if k not in r]
            if missing:
                raise ValueError(f'rate card: models."{r["model"]}" needs {missing} (USD per million tokens)')
            text = {"prefill": float(r["prefill"])}
            text["prefill_cached"] = float(r.get("prefill_cached", CACHED_FRACTION * text["prefill"]))
            rows[key] = ModelPrices(
                model=r["model"],
                **text,
                sample=float(r["sample"]),
                train=float(r["train"]),
                **{part: float(r.get(part, text[whole])) for part, whole in IMAGE_PHASES.items()},
                storage_gb_month=float(r.get("storage_gb_month", storage if storage is not None else 0.0)),
                note=str(r.get("note", "")),
            )
        return cls(rows, currency, tuple(s for s, _ in texts))

    @classmethod
    def from_models_list(cls, models: list[dict], currency: str = "USD") -> RateCard:
        """The inverse of `as_models_list` (a server's /api/trine/v1/rates answer)."""
        rows = {}
        for m in models:
            p = m["pricing"]
            rows[model_key(m["model_id"])] = ModelPrices(
                m["model_id"],
                **{  # an older server names no image prices: its images were priced as text
                    k: _price(p[k] if k in p else p[IMAGE_PHASES[k]], f"{m['model_id']}.{k}")
                    for k in (*BILLED_PHASES, "storage_gb_month")
                },
                note=m.get("description", ""),
            )
        return cls(rows, currency)

    def price(self, model: str, *, full: bool = False) -> ModelPrices:
        """The row that prices `model` (with `full`, its full fine-tuning row: `<model>:full`, else
        `default:full`, else its own row)."""
        if full:
            row = self.rows.get(model_key(model) + FULL_SUFFIX) or self.rows.get(DEFAULT_ROW + FULL_SUFFIX)
            if row is not None:
                return row
        return self.rows.get(model_key(model)) or self.rows[DEFAULT_ROW]

    def require(self, model: str) -> ModelPrices:
        """The row named `model` (the "default" row only when asked by that name); ValueError naming
        the card's models and how to add one otherwise."""
        row = self.rows.get(model_key(model))
        if row is None:
            names = ", ".join(sorted(p.model for k, p in self.rows.items() if k != DEFAULT_ROW))
            raise ValueError(
                f"model {model!r} is not on the rate card ({names}, or `default` for the "
                f'default row); add a [models."{model}"] row to $TRINE_HOME/rates.toml or '
                "a file passed with --rates"
            )
        return row

    def cost(self, usage, model: str | None = None) -> dict[str, float]:
        """Cost by billed phase plus "total", for a UsageEvent (priced at its base_model) or any object with
        the phase attributes (prefill, prefill_cached, sample, train; the image phases, if it has
        them), priced at `model`. "prefill" and "prefill_cached" are their text tokens' cost; a full
        fine-tuning event's `train` is priced at the model's full row."""
        model = model if model is not None else getattr(usage, "base_model", DEFAULT_ROW)
        p = self.price(model)
        train = self.price(model, full=True) if getattr(usage, "full_fine_tuning", False) else p
        tokens = {ph: getattr(usage, ph, 0) or 0 for ph in BILLED_PHASES}
        tokens["prefill"] -= tokens["prefill_image"]
        tokens["prefill_cached"] -= tokens["prefill_image_cached"]
        out = {ph: tokens[ph] * getattr(train if ph == "train" else p, ph) / 1e6 for ph in BILLED_PHASES}
        out["total"] = sum(out.values())
        return out

    def storage_cost(self, model: str, gb_months: float) -> float:
        return gb_months * self.price(model).storage_gb_month

    def pricing(self, model: str) -> dict:
        """The prices that apply to `model`, as a JSON-ready dict (for a models-list item's "pricing")."""
        p = self.price(model)
        return {
            "currency": self.currency,
            "unit": "per_million_tokens",
            **{k: money(getattr(p, k)) for k in (*BILLED_PHASES, "storage_gb_month")},
            "train_full": money(self.price(model, full=True).train),  # full fine-tuning's tokens
            "rate_row": p.model,
        }

    def as_models_list(self) -> list[dict]:
        """Every row as `{"model_id", "description", "pricing"}`: extra fields a models-list item can carry
        (the PyTRIO client ignores fields it does not know)."""
        return [
            {"model_id": p.model, "description": p.note, "pricing": self.pricing(p.model)}
            for p in self.rows.values()
        ]


def _price(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where} must be a number >= 0 (USD), got {v!r}")
    return float(v)
