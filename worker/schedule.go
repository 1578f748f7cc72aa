package worker

import (
	"context"
	"errors"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

func (p *Producer) schedule(ctx context.Context, msg *nats.Msg, part leasehold.Partition, o enqueueOpts) error {
	return errors.New("worker: delayed jobs are not built yet")
}
