"""Helpers the tests share (not tests themselves): oracles, engines, the command-line tools run in-process."""
