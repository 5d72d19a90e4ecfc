"""Stage report: the pre-registered findings and their verdicts, and the report as markdown
and self-contained HTML (flows/report.py runs it)."""
