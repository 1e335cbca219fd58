"""The architectures, one module each: every module here defines an `Architecture` subclass
registered with `@register_arch(general.architecture)` (graphs/models/arch.py). The registry imports
all of them (pkgutil) when it looks a name up, so a new architecture is a new module here and
nothing else: no list of names, no import to register it.
"""
