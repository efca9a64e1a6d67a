"""`kiln ci`: rebuild, verify and publish plans whenever what they were built from changes.

    specs/*.yaml --assess--> reuse | build | fail          (kiln ci plan: the dry run)
                              build --> verify --> publish (store/plans/<fp>/, then the
                                                            pointer store/current/<name>.json)
                 --> report.md + report.json (kiln ci rebuild)

store.py: the content-addressed plan store; assess.py: what to do per spec and why;
pipeline.py: the rebuild run; report.py: markdown and JSON. Nothing here imports torch at
module level: a dry run over plans that exist answers from quick keys alone.
"""
