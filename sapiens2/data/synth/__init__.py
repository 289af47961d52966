"""Procedural synthetic humans: ray-cast articulated bodies with labels for all Sapiens2 tasks,
plus a web-like pool of person images and labelled distractors for curation.
"""

from sapiens2.data.synth.labels import (FLIP_PAIRS, KEYPOINT_NAMES, KEYPOINT_SEG_CLASSES,
                                        SEG_CLASSES, SEG_FLIP, SKELETON)
from sapiens2.data.synth.person import PersonSample, render_person
from sapiens2.data.synth.pool import EXPECTED, KINDS, DistractorMix, generate_pool, plan_pool
from sapiens2.data.synth.sample_io import read_sample, write_sample

__all__ = [
    "DistractorMix", "EXPECTED", "FLIP_PAIRS", "KEYPOINT_NAMES", "KEYPOINT_SEG_CLASSES", "KINDS",
    "PersonSample", "SEG_CLASSES", "SEG_FLIP", "SKELETON", "generate_pool", "plan_pool",
    "read_sample", "render_person", "write_sample",
]
