"""A job with a bad configuration must fail on every rank before any collective (no hang).

usage: python bad_config.py DEVICES STRATEGY_NAME JSON_KWARGS   (Lightning's launcher)
"""

import json
import sys

from _common import Classifier, trainer

from lightning_dist.strategies import REGISTERED

devices, name, kwargs = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
cls, _, params = REGISTERED[name]
strategy = cls(**{**params, **kwargs})
trainer(strategy, devices=devices, steps=1).fit(Classifier())
