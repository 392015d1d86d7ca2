"""The embedded demo model: a small chat model trained by the project itself (in progress)."""
