"""The cache wing: the paged KV pool, the compact prefix cache and how requests use it (lookup,
attach, compact-and-cache, conversation extensions), compaction selectors, the vision-feature
cache and the masked dense oracle of compaction. It never imports the serving core."""
