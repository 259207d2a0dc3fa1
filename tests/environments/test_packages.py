"""Environment packages: a spec without ':' names what an installed package declares."""

from __future__ import annotations

import pytest

from environments import Counter, EnvironmentSpecError, resolve_environment
from environments.packages import EnvironmentPackage, installed_environments

SUMS = '''
class Sums:
    """Add numbers."""

    def reset(self, a: int) -> str:
        return f"Start at {a}."
'''


def refusal(spec: str) -> str:
    with pytest.raises(EnvironmentSpecError) as caught:
        resolve_environment(spec)
    return str(caught.value)


def test_a_bare_name_resolves_to_the_class_its_installed_package_declares(site):
    site.install("sums-pkg", "1.2", {"sums": "sums_pkg_env:Sums"}, {"sums_pkg_env": SUMS})
    cls = resolve_environment("sums")
    assert cls.__name__ == "Sums" and cls.__module__ == "sums_pkg_env"
    assert resolve_environment("sums_pkg_env:Sums") is cls
    assert EnvironmentPackage("sums", "sums_pkg_env:Sums", "sums-pkg", "1.2") in (
        installed_environments()
    )


def test_a_package_taking_a_builtins_name_is_refused_naming_both_and_env_still_works(site):
    site.install("shadow", "0.3", {"Counter": "shadow_env:Sums"}, {"shadow_env": SUMS})
    message = refusal("Counter")
    assert "both the built-in env:Counter and an environment of package shadow 0.3" in message
    assert "'env:Counter' or 'shadow_env:Sums'" in message
    assert resolve_environment("env:Counter") is Counter


def test_a_name_two_packages_declare_is_refused_naming_both(site):
    site.install("first", "1.0", {"sums": "first_env:Sums"}, {"first_env": SUMS})
    site.install("second", "2.0", {"sums": "second_env:Sums"}, {"second_env": SUMS})
    message = refusal("sums")
    assert "declared by 2 installed packages" in message
    assert "first 1.0 as 'first_env:Sums'" in message
    assert "second 2.0 as 'second_env:Sums'" in message


def test_an_unknown_name_lists_the_installed_ones_and_suggests_the_nearest(site):
    site.install("sums-pkg", "1.2", {"sums": "sums_pkg_env:Sums"}, {"sums_pkg_env": SUMS})
    message = refusal("sum")
    assert "'sum' is not an installed environment package (did you mean 'sums'?)" in message
    assert "installed: sums." in message and "'env:Name' (a built-in)" in message


def test_a_builtins_name_without_env_prefix_suggests_the_builtin():
    message = refusal("counter")
    assert "(did you mean 'env:Counter'?)" in message


@pytest.mark.parametrize(
    ("target", "module", "expected"),
    [
        (
            "broken_env:Sums",
            "raise RuntimeError('no licence key')",
            "environment 'sums' of package broken 0.1 points at 'broken_env:Sums', and loading "
            "it raised RuntimeError: no licence key",
        ),
        ("broken_env:Summs", SUMS, "loading it raised AttributeError"),
        ("broken_env:helper", "def helper(): pass", "'sums' names a function, not a class"),
    ],
)
def test_an_entry_point_that_does_not_load_an_environment_is_named_with_its_package(
    site, target, module, expected
):
    site.install("broken", "0.1", {"sums": target}, {"broken_env": module})
    assert expected in refusal("sums")
