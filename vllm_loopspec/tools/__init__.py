"""Command-line tools: checkpoint maker, install fixes."""
