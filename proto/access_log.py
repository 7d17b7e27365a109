"""The protobuf boundary of the response path: Envoy's OpenTelemetry access log.

Envoy writes one access-log record per request when the request ends (success, upstream
error or client reset) and sends them in batches over gRPC
(`opentelemetry.proto.collector.logs.v1.LogsService/Export`), so the picker learns how
each response went from one small record instead of every response chunk.

The record's body is a single string formatted by Envoy (`RECORD_FORMAT`): status, the
upstream that answered, the time from sending the request upstream to the first byte of
the response *body* (for a stream, the first token: vLLM sends its headers at once), the
time to the end of the response, Envoy's response flags and the request id. The picker
decodes only that string, with message classes built here from the few OTLP fields it
reads (the field numbers of the OTLP wire format), so no OpenTelemetry package is needed
and the stale copy of the OTLP protos some Envoy proto packages bundle cannot clash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

LOGS_SERVICE_NAME = "opentelemetry.proto.collector.logs.v1.LogsService"
RECORD_TAG = "epp1"
# Space-separated; the request id comes last because a client may put spaces in it.
RECORD_FORMAT = (
    f"{RECORD_TAG} %RESPONSE_CODE% %UPSTREAM_HOST%"
    " %COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%"
    " %COMMON_DURATION(US_TX_BEG:US_RX_END:us)%"
    " %RESPONSE_FLAGS% %REQ(x-request-id)%"
)


def _build_messages() -> dict[str, Any]:
    """Message classes for the OTLP fields the picker reads, in a private pool."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="smart_epp_otlp_logs.proto", package="otlp")

    def message(name: str, *fields: tuple[str, int, int, str | None]) -> None:
        m = file.message_type.add(name=name)
        for field_name, number, label, type_name in fields:
            field = m.field.add(name=field_name, number=number, label=label)
            if type_name is None:
                field.type = f.TYPE_STRING
            else:
                field.type = f.TYPE_MESSAGE
                field.type_name = f".otlp.{type_name}"

    optional, repeated = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    message("AnyValue", ("string_value", 1, optional, None))
    message("LogRecord", ("body", 5, optional, "AnyValue"))
    message("ScopeLogs", ("log_records", 2, repeated, "LogRecord"))
    message("ResourceLogs", ("scope_logs", 2, repeated, "ScopeLogs"))
    message("ExportLogsServiceRequest", ("resource_logs", 1, repeated, "ResourceLogs"))
    message("ExportLogsServiceResponse")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"otlp.{name}"))
        for name in ("ExportLogsServiceRequest", "ExportLogsServiceResponse")
    }


_MESSAGES = _build_messages()
ExportLogsServiceRequest = _MESSAGES["ExportLogsServiceRequest"]
ExportLogsServiceResponse = _MESSAGES["ExportLogsServiceResponse"]
_EMPTY_RESPONSE: bytes = ExportLogsServiceResponse().SerializeToString()


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """How one request ended, as Envoy logged it."""

    request_id: str
    status: int  # 0 when no response came (client reset, upstream connect failure)
    upstream: str | None  # "ip:port" of the endpoint that answered
    first_body_byte_s: float | None  # request sent upstream -> first response body byte
    upstream_done_s: float | None  # request sent upstream -> last response byte
    flags: str  # Envoy's response flags, e.g. "DC" (downstream reset), "UF"; "" for none


def _seconds(text: str) -> float | None:
    return int(text) / 1e6 if text.isdigit() else None


def parse_record(body: str) -> ResponseRecord | None:
    """The record in one log body, or None for a body this format did not write."""
    parts = body.split(" ", 6)
    if len(parts) != 7 or parts[0] != RECORD_TAG:
        return None
    _, status, upstream, first_body, done, flags, request_id = parts
    return ResponseRecord(
        request_id=request_id,
        status=int(status) if status.isdigit() else 0,
        upstream=upstream if upstream != "-" else None,
        first_body_byte_s=_seconds(first_body),
        upstream_done_s=_seconds(done),
        flags="" if flags == "-" else flags,
    )


def read_records(request: Any) -> list[ResponseRecord]:
    """Every smart-epp record in one Export request."""
    records: list[ResponseRecord] = []
    for resource in request.resource_logs:
        for scope in resource.scope_logs:
            for log_record in scope.log_records:
                record = parse_record(log_record.body.string_value)
                if record is not None:
                    records.append(record)
    return records


def add_logs_service(
    server: grpc.aio.Server,
    on_records: Callable[[list[ResponseRecord]], None],
) -> None:
    """Registers the OTLP LogsService on `server`, handing each batch to `on_records`."""

    async def export(request: Any, context: grpc.aio.ServicerContext) -> bytes:
        on_records(read_records(request))
        return _EMPTY_RESPONSE

    handlers = {
        "Export": grpc.unary_unary_rpc_method_handler(
            export,
            request_deserializer=ExportLogsServiceRequest.FromString,
            response_serializer=bytes,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(LOGS_SERVICE_NAME, handlers),)
    )


def export_request(bodies: list[str]) -> bytes:
    """A serialized Export request carrying `bodies` (for tests and benchmarks)."""
    request = ExportLogsServiceRequest()
    scope = request.resource_logs.add().scope_logs.add()
    for body in bodies:
        scope.log_records.add().body.string_value = body
    serialized: bytes = request.SerializeToString()
    return serialized


__all__ = [
    "LOGS_SERVICE_NAME",
    "RECORD_FORMAT",
    "ExportLogsServiceRequest",
    "ResponseRecord",
    "add_logs_service",
    "export_request",
    "parse_record",
    "read_records",
]
