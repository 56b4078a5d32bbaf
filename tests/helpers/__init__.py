"""Code the tests share: recipes and parametrization tables (``*_cases``), the bodies spawned ranks run
(``*_runs``, ``*_script``), reference runs and checks (``parity``, ``checkpoint``, ``resume``, ``reliability``,
``ds``, ``ds_moe``), and the model sweep. Imported as ``helpers.<module>`` (``tests/`` is on the path).
"""
