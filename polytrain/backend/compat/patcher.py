"""Reversible monkey-patching: every change the shim makes goes through one Patcher, so
`uninstall()` restores torch exactly, and names imported before the shim can be found and rebound.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from types import ModuleType
from typing import Any, Callable

_MISSING = object()

# Modules whose globals the rebinding scan leaves alone: torch's own internals keep the real
# objects (their CUDA paths are guarded by the real torch.cuda), and polytrain's backends must
# keep talking to the real CUDA (backend/cuda.py holds the real module on purpose).
_KEEP = ("torch", "polytrain.backend", "importlib")


def _kept(module_name: str) -> bool:
    return any(module_name == k or module_name.startswith(k + ".") for k in _KEEP)


def with_arguments(fn: Callable, transform: Callable[[dict[str, Any]], None]) -> Callable:
    """Wrap a Python function so `transform` may rewrite its arguments by name before the call."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        transform(bound.arguments)
        return fn(*bound.args, **bound.kwargs)

    return wrapper


class _HookedLoader(importlib.abc.Loader):
    """Runs the real loader, then a patch function on the fresh module."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Patches modules that are too costly to import up front (FSDP: seconds) when, and only
    when, the program imports them."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[ModuleType], None]] = {}
        self._finding: set[str] = set()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.hooks or name in self._finding:
            return None
        self._finding.add(name)  # find the real spec through the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.discard(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, self.hooks.pop(name))
        return spec


class Patcher:
    """Records each attribute it sets so `undo()` can put the original back."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.replacements: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, new)
        self._hooks = _PostImportHooks()

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Set owner.name = value; returns the value it had (through inheritance too)."""
        own = vars(owner).get(name, _MISSING)  # not inherited: undo must not copy it down
        original = getattr(owner, name, None)
        self._undo.append(lambda: setattr(owner, name, own) if own is not _MISSING
                          else delattr(owner, name))
        setattr(owner, name, value)
        if original is not None and original is not value:
            self.note_replacement(original, value)
        return original

    def on_undo(self, restore: Callable[[], None]) -> None:
        """Run `restore` on undo, in reverse order with the attribute changes."""
        self._undo.append(restore)

    def note_replacement(self, original: Any, new: Any) -> None:
        """Let `rebind_imported_names` replace `original` wherever a module imported it."""
        self.replacements[id(original)] = (original, new)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """owner.name = make(original owner.name)."""
        self.set(owner, name, make(getattr(owner, name)))

    def wrap_arguments(self, owners: tuple[Any, ...], name: str,
                       transform: Callable[[dict[str, Any]], None]) -> None:
        """Rewrite the arguments of the function `name`, wherever in `owners` it is bound."""
        original = getattr(owners[0], name)
        wrapped = with_arguments(original, transform)
        for owner in owners:
            if getattr(owner, name, None) is original:
                self.set(owner, name, wrapped)

    def set_module(self, name: str, module: ModuleType) -> None:
        """sys.modules[name] = module, restored on undo."""
        own = sys.modules.get(name, _MISSING)
        self._undo.append(lambda: sys.modules.__setitem__(name, own) if own is not _MISSING
                          else sys.modules.pop(name, None))
        sys.modules[name] = module

    def when_imported(self, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        """Apply `patch` to the module now if it is loaded, else right after it is imported."""
        module = sys.modules.get(module_name)
        if module is not None:
            patch(module)
            return
        if self._hooks not in sys.meta_path:
            sys.meta_path.insert(0, self._hooks)
        self._hooks.hooks[module_name] = patch

    def rebind_imported_names(self) -> int:
        """Point names that other modules imported before the shim (`from torch.cuda import
        Event`, `from torch import cuda`) at their replacements. Returns how many it rebound.

        Only module globals can be reached: a name captured in a closure, a default argument
        or a class attribute keeps the original.
        """
        count = 0
        for module_name, module in list(sys.modules.items()):
            if module is None or _kept(module_name):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for key, value in list(namespace.items()):
                hit = self.replacements.get(id(value))
                if hit is not None and hit[0] is value and not key.startswith("__"):
                    self.set(module, key, hit[1])
                    count += 1
        return count

    def undo(self) -> None:
        """Restore everything, newest first, and stop patching future imports."""
        if self._hooks in sys.meta_path:
            sys.meta_path.remove(self._hooks)
        self._hooks.hooks.clear()
        while self._undo:
            self._undo.pop()()
        self.replacements.clear()
