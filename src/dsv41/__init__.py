"""dsv41: DeepSeek-V4.1-Flash inference appliance."""


def __getattr__(name: str):
    """`dsv41.__version__`, looked up on first use (package metadata; a source tree that was never installed
    reads its pyproject.toml)."""
    if name != "__version__":
        raise AttributeError(f"module 'dsv41' has no attribute {name!r}")
    from importlib import metadata

    try:
        return metadata.version("dsv41")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"
