package httpsink_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/httpsink"
)

// A receiver you own, behind a Verifier: a relay's request at epoch 8 is
// handled; a repeat of it is answered from the key store without the
// handler; the request of a paused relay still at epoch 7 is refused with
// 409 and a body naming epoch 8 and its holder.
func ExampleVerifier() {
	quiet := slog.New(slog.DiscardHandler)
	// Memory stores by default: kvsink or pgsink fences and KVKeys or
	// PostgresKeys for a receiver of many processes.
	v, err := httpsink.NewVerifier(httpsink.VerifierConfig{RequireRelay: true, Logger: quiet})
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st, _ := httpsink.StampFrom(r.Context())
		fmt.Println("handler: charge for", st.Key)
	})))
	defer srv.Close()

	send := func(relayEpoch leasehold.Epoch, holder string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"order":"o-1"}`))
		// What a relay sends: the effect's stamp and Idempotency-Key, and
		// its lock's stamp.
		httpsink.SetStamp(req.Header, leasehold.Stamp{Scope: "shop", Partition: 0, Epoch: 3, Acquisition: "w3", Key: "shop.0.17.0", Worker: "worker-1"})
		httpsink.SetRelayHeader(req.Header, leasehold.Lease{Scope: "shop/http-relay", Epoch: relayEpoch, Acquisition: "r" + relayEpoch.String(), Holder: holder})
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		var ref httpsink.Refusal
		_ = json.NewDecoder(resp.Body).Decode(&ref)
		switch {
		case resp.StatusCode == http.StatusConflict:
			fmt.Printf("%s: %d %s: superseded by epoch %d of %s\n", holder, resp.StatusCode, ref.Error, ref.Max, ref.Holder)
		case resp.Header.Get(httpsink.HeaderReplayed) == "true":
			fmt.Printf("%s: %d, replayed without the handler\n", holder, resp.StatusCode)
		default:
			fmt.Printf("%s: %d\n", holder, resp.StatusCode)
		}
	}
	send(8, "relay-b")
	send(8, "relay-b")
	send(7, "relay-a")
	// Output:
	// handler: charge for shop.0.17.0
	// relay-b: 200
	// relay-b: 200, replayed without the handler
	// relay-a: 409 stale_epoch: superseded by epoch 8 of relay-b
}
