"""The Python API: `import mkdsl`, then load a spec, compile it, build its reference and its
kernel. See docs/python-api.md."""

from __future__ import annotations

from mkdsl.diagnostics import did_you_mean
from mkdsl.syntax import Module, ProfileDecl


class ProfileError(ValueError):
    """A profile the spec does not declare (the CLI reports it as a usage error)."""


def spec_profiles(module: Module) -> list[str]:
    """The profiles a parsed spec declares, in order."""
    return list(dict.fromkeys(it.name for it in module.items if isinstance(it, ProfileDecl)))


def check_profile(module: Module, profile: str | None, path: str) -> None:
    """Raise ProfileError unless `profile` is None or one the spec declares."""
    names = spec_profiles(module)
    if profile is None or profile in names:
        return
    known = f"its profiles: {', '.join(names)}" if names else "it declares no profiles"
    hint = did_you_mean(profile, names)
    raise ProfileError(f"no profile named `{profile}` in {path}; {known}{f' ({hint})' if hint else ''}")
