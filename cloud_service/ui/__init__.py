"""The review UI: server-rendered pages for reviewers and admins (see ``routes``)."""
