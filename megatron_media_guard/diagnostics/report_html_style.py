"""Inline style of the post-mortem page (:mod:`.report_html`): system fonts only, no asset."""

from __future__ import annotations

# sequential, light to dark (ColorBrewer YlOrRd, 8 classes)
PALETTE = ("#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026")

_LEVELS = "".join(f".l{i + 1}{{fill:{c};background:{c}}}" for i, c in enumerate(PALETTE))

CSS = (
    "body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;"
    "color:#1b1f24;background:#fff;max-width:1400px}"
    "h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;margin:28px 0 8px;"
    "border-bottom:1px solid #d0d7de;padding-bottom:4px}"
    "dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0 0 8px}"
    "dt{color:#57606a}dd{margin:0}"
    "code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;"
    "overflow-wrap:anywhere}"
    ".ev{display:inline-block;padding:1px 8px;margin:2px 4px 2px 0;border-radius:10px;"
    "background:#eaeef2;font-size:13px}"
    ".ev.drop{background:#fed976}.ev.repair{background:#c6e2ff}.ev.raise{background:#ff8182}"
    ".ev.budget{background:#fdb4d8}"
    ".fatal{border-left:4px solid #cf222e;background:#fff5f5;padding:8px 12px;margin:8px 0}"
    ".ok{color:#1a7f37}"
    ".note{color:#57606a;margin:4px 0 8px}.bin{color:#1b1f24}"
    ".scroll{overflow-x:auto}"
    "svg text{font:11px system-ui,sans-serif;fill:#57606a}"
    "svg .axis{font-size:12px;fill:#1b1f24}"
    "svg .bg{fill:#f6f8fa;stroke:#d0d7de}"
    "svg rect.x{stroke:#000;stroke-width:1.5px}"
    "svg rect:hover{stroke:#0969da;stroke-width:2px}"
    "svg .bar{fill:#57606a}svg .bar.drop{fill:#feb24c}svg .bar.repair{fill:#0969da}"
    "svg .bar.raise{fill:#cf222e}svg .bar.budget{fill:#bf3989}"
    "svg .mark{fill:none;stroke:#000;stroke-width:2px;pointer-events:none}"
    + _LEVELS
    + ".legend{font-size:12px;color:#57606a}"
    ".sw{display:inline-block;width:14px;height:10px;margin:0 3px 0 8px;vertical-align:middle;"
    "border:1px solid #d0d7de}.sw.x{border:2px solid #000}"
    ".series{display:flex;align-items:flex-end;gap:12px;margin:6px 0;"
    "border-bottom:1px solid #eaeef2}"
    ".slabel{width:190px;flex:none;font-size:12px;color:#57606a;overflow-wrap:anywhere}"
    ".slabel b{color:#1b1f24}"
    "table{border-collapse:collapse;margin:4px 0;font-size:13px}"
    "th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}"
    "th{background:#f6f8fa}"
    "td{overflow-wrap:anywhere}"
    "table.reasons td:nth-child(2){max-width:520px}"
    "table.reasons td:nth-child(3){max-width:560px;font:12px ui-monospace,monospace;"
    "color:#57606a}"
    "table.num td:not(:first-child){text-align:right}"
    "footer{margin-top:32px;color:#8c959f;font-size:12px}"
)
