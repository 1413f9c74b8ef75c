"""What pyproject.toml cannot say: the UI lives in the top-level app/ folder (the project's layout)
but installs inside asyncrl's namespace, as ``asyncrl.app``, so no generic ``app`` package lands in
site-packages. Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["asyncrl", "asyncrl.*"]), "asyncrl.app"],
    package_dir={"asyncrl.app": "app"},
    package_data={"asyncrl.app": ["*.js"]},
)
