"""Delivery of step records: worker thread, HTTP sender and on-disk spool."""
