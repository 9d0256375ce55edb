"""The training run: the loop (loop.py), its configuration, checkpoints, and the snapshots that let
it go on when a worker is lost.

Called, this package trains: hetconv.train(net="lenet5", workers=["cpu", "cpu"], ...) is
hetconv.api.train, the Python API's name for it (help(hetconv.api.train))."""
import sys
import types


class _CallablePackage(types.ModuleType):
    # The API's hetconv.train(...) and this package share the name `train` on the package root,
    # where an import of any module here sets the package itself: so the package is what is
    # called. A module's class may be swapped for a ModuleType subclass; nothing else changes.
    def __call__(self, **flags):
        """hetconv.api.train(**flags): train as hetconv-coordinator does with these flags."""
        from hetconv import api        # the API sits above this package: loaded when first called
        return api.train(**flags)


sys.modules[__name__].__class__ = _CallablePackage
