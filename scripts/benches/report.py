"""What a bench prints, in one format: its figures as tables, each row printed as it is
measured (the first column, a row's name, on the left; figures right-aligned under their
column names) and kept as numbers for the entry's JSON line; and notes, a line each, for
what a table cannot hold (the setup measured, a target met or missed, a ratio between rows,
the CPU a run used). The entry (scripts/bench.py) reads `kept()` once the bench returns."""

import math

_kept: dict[str, list] = {"tables": [], "notes": []}
MIN_WIDTH = 8


def cell(value) -> str:
    """A figure as the terminal shows it: floats to the digits that matter at their size
    (a rate of 1234.5, a ratio of 1.25, a fraction of 0.873 or 4.2e-05), None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def kept_value(value):
    """A cell as the JSON line keeps it: numpy's scalars as Python's, floats to 7 digits,
    a NaN or an infinity as None (the line stays strict JSON); anything else is refused
    here, at the row, not after the run when the line is written."""
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
        value = value.item()  # a numpy scalar
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"a table cell is a number, text or None, got {type(value).__name__}")
    if isinstance(value, float):
        return float(f"{value:.7g}") if math.isfinite(value) else None
    return value


class Table:
    """A table of figures: its title and column names printed when it is made, a row when
    it is measured. `widths` may widen a column for cells longer than its name."""

    def __init__(self, title: str, *columns: str, widths: dict[str, int] | None = None):
        self.columns, self.rows = columns, []
        self._widths = [max(MIN_WIDTH, len(name), (widths or {}).get(name, 0)) for name in columns]
        _kept["tables"].append({"title": title, "columns": list(columns), "rows": self.rows})
        print(f"\n{title}" if _kept["tables"][:-1] or _kept["notes"] else title, flush=True)
        self._print(columns)

    def row(self, *values) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"a row of {len(self.columns)} columns {self.columns}, got {len(values)} values")
        row = [kept_value(value) for value in values]
        self.rows.append(row)
        self._print([cell(value) for value in row])

    def _print(self, cells) -> None:
        first, *rest = cells
        print("  ".join([f"{first:<{self._widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(rest, self._widths[1:])]),
              flush=True)


def note(text: str) -> None:
    """A line of prose beside the tables, printed and kept."""
    _kept["notes"].append(text)
    print(text, flush=True)


def kept() -> dict[str, list]:
    return _kept
