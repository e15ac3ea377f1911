"""Static HTML report pages assembled from saved tables and figures."""

from rdepth.report.html import Report, Section, add_section, format_value, load_sections, render

__all__ = ["Report", "Section", "add_section", "format_value", "load_sections", "render"]
