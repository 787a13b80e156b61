"""Parameters every request of an S3 store carries, whichever of our calls or boto3's
transfer layer makes it (docs/s3.md, "Bucket owner, requester pays, KMS").

``expected_bucket_owner`` (``ExpectedBucketOwner``): S3 refuses the request with 403
when the bucket belongs to another account (a bucket deleted and re-created by someone
else under the same name). ``request_payer`` (``RequestPayer: requester``): for buckets
whose owner charges the requester. ``sse_kms_key_id``: new objects are encrypted with
this KMS key (``ServerSideEncryption: aws:kms``, ``SSEKMSKeyId``).

They are added by a botocore event hook on the store's client, to each operation whose
input takes them and only for the store's own bucket, so no call site can forget one.
"""

from __future__ import annotations

import re

_ACCOUNT = re.compile(r"[0-9]{12}")
_ENCRYPTING = {"PutObject", "CreateMultipartUpload"}  # the operations that create objects


class RequestArgs:
    def __init__(self, bucket: str, *, expected_bucket_owner: str | None = None, request_payer: bool = False,
                 sse_kms_key_id: str | None = None):
        if expected_bucket_owner is not None and not _ACCOUNT.fullmatch(str(expected_bucket_owner)):
            raise ValueError(f"expected_bucket_owner must be a 12-digit AWS account id, got {expected_bucket_owner!r}")
        if sse_kms_key_id is not None and (not isinstance(sse_kms_key_id, str) or not sse_kms_key_id):
            raise ValueError(f"sse_kms_key_id must be a KMS key id or ARN, got {sse_kms_key_id!r}")
        self.bucket = bucket
        self.every: dict[str, str] = {}
        if expected_bucket_owner is not None:
            self.every["ExpectedBucketOwner"] = str(expected_bucket_owner)
        if request_payer:
            self.every["RequestPayer"] = "requester"
        self.creating: dict[str, str] = {}
        if sse_kms_key_id is not None:
            self.creating = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": sse_kms_key_id}

    def __bool__(self) -> bool:
        return bool(self.every or self.creating)

    def register(self, client) -> None:
        """Add the parameters to every request ``client`` makes to this store's bucket."""
        client.meta.events.register("before-parameter-build.s3", self._add,
                                    unique_id=f"ckptstore-request-args-{self.bucket}-{id(self)}")

    def _add(self, params, model, **_kwargs) -> None:
        if params.get("Bucket") != self.bucket:
            return
        members = model.input_shape.members if model.input_shape is not None else {}
        wanted = {**self.every, **(self.creating if model.name in _ENCRYPTING else {})}
        for name, value in wanted.items():
            if name in members:
                params.setdefault(name, value)
