"""The lines every screen shares: the title bar and the outage banner (which also says stale data)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, cast

from rich.text import Text
from textual.widgets import Static

from qconsole.widgets import fmt

if TYPE_CHECKING:
    from qconsole.app import QConsoleApp


class TitleBar(Static):
    """``qconsole │ Overview │ READ-ONLY │ ⟳ requeue… │ ☠ 2 crashes (w) │ data 12:00:00 UTC │ source``: one
    line. The source comes last: at 80 columns it is what is cut."""

    DEFAULT_CSS = """
    TitleBar {
        height: 1;
        background: $panel;
        color: $foreground;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.title_text = title

    @property
    def qapp(self) -> QConsoleApp:
        return cast("QConsoleApp", self.app)

    def on_mount(self) -> None:
        self.watch(self.app, "last_ok", self._paint, init=True)
        self.watch(self.app, "db_error", self._paint, init=False)
        self.watch(self.app, "acting", self._paint, init=False)
        self.watch(self.app, "crashes_unseen", self._paint, init=False)

    def repaint(self) -> None:
        self._paint()

    def _paint(self, _value: object = None) -> None:
        app = self.qapp
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" qconsole ", style="bold")
        t.append("│ ")
        t.append(self.title_text, style="bold")
        t.append(" │ ")
        if app.read_only:
            t.append("READ-ONLY", style="reverse")
            t.append(" │ ")
        if app.db_error is not None:
            t.append("✗ OFFLINE", style="bold reverse")
            t.append(" │ ")
        if app.acting:
            t.append(f"⟳ {', '.join(app.acting)}…", style="bold")
            t.append(" │ ")
        if app.crashes_unseen:
            n = app.crashes_unseen
            t.append(f"☠ {n} crash{'es' if n != 1 else ''} (w)", style="bold reverse")
            t.append(" │ ")
        at = _data_at(self)
        t.append(f"data {fmt.hms(at)} UTC" if at else "loading…")
        t.append(" │ ")
        t.append(app.backend.description)
        self.update(t)


def _data_at(widget: Static) -> dt.datetime | None:
    """When the data of the widget's screen was read (ConsoleScreen.data_at)."""
    at = getattr(widget.screen, "data_at", None)
    return at if isinstance(at, dt.datetime) else None


class OutageBanner(Static):
    """Shown while reads fail: what failed, and how old the data on screen is. Hidden otherwise. Red while the
    database is unreachable; in the warning color while it answers the screen's reads with an error (a
    statement timeout behind a table lock): the figures shown are the last ones read either way."""

    DEFAULT_CSS = """
    OutageBanner {
        display: none;
        height: auto;
        max-height: 3;
        background: $error;
        color: $text;
        text-style: bold;
        padding: 0 1;
    }
    OutageBanner.-shown {
        display: block;
    }
    OutageBanner.-stale {
        display: block;
        background: $warning;
    }
    """

    @property
    def qapp(self) -> QConsoleApp:
        return cast("QConsoleApp", self.app)

    def on_mount(self) -> None:
        self.watch(self.app, "db_error", self._paint, init=True)
        self.set_interval(1.0, self._tick)

    def repaint(self) -> None:
        self._paint()

    def _tick(self) -> None:
        if self.qapp.db_error is not None or self._read_error() is not None:
            self._paint()

    def _read_error(self) -> str | None:
        """The error of the last read of the banner's screen, if the database answered it with one
        (ConsoleScreen.read_error)."""
        error = getattr(self.screen, "read_error", None)
        return error if isinstance(error, str) else None

    def _paint(self, _value: object = None) -> None:
        app = self.qapp
        outage = app.db_error
        stale = None if outage is not None else self._read_error()
        self.set_class(outage is not None, "-shown")
        self.set_class(stale is not None, "-stale")
        error = outage if outage is not None else stale
        if error is None:
            return
        now = app.clock.now()
        at = _data_at(self)
        age = "no data on this screen yet" if at is None else f"data from {fmt.hms(at)} UTC ({fmt.ago(at, now)})"
        t = Text()
        t.append("⚠ DATABASE UNREACHABLE" if outage is not None else "⚠ READS FAILING", style="bold")
        t.append(f" · {age} · retrying\n")
        t.append(fmt.clip(error, 200), style="not bold")
        self.update(t)
