# syntax=docker/dockerfile:1
#
# The leasehold command as a container image: a static binary on a distroless
# base that runs as a non-root user. Build from the repository root:
#
#   docker build -t leasehold:dev .
#
# deploy/docker-compose.yml and deploy/kubernetes/ run this image.

# The Go release must be at least the one go.mod names.
ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION} AS build
WORKDIR /src
# Modules first, so that a source change does not download them again.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# CGO off gives a static binary that needs no libc in the final image;
# -trimpath keeps build paths out of it.
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags="-s -w" -o /out/leasehold ./cmd/leasehold

# distroless/static has CA certificates (for NATS and PostgreSQL over TLS)
# and time zone data, and no shell. Its "nonroot" user is 65532.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/leasehold /leasehold
USER 65532:65532
# worker and sink serve /metrics, /livez and /readyz here (--http).
EXPOSE 8080 8081
ENTRYPOINT ["/leasehold"]
CMD ["--help"]
