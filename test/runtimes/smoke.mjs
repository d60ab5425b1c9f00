// Runs the built bundle (dist/index.mjs, what users get) in Deno or Bun against an edgepg-proxy on
// 127.0.0.1, with that runtime's own global WebSocket and fetch. Reads EDGEPG_SMOKE (JSON:
// { proxyPort, host, port, database, password }) from the environment, prints one JSON line with
// what the checks (checks.js) saw and exits 0, or prints { ok: false, error } and exits 1.
// test/runtimes.test.ts spawns it and checks the JSON.
import * as edgepg from '../../dist/index.mjs'
import './checks.js'

const env = (name) => (globalThis.Deno ? Deno.env.get(name) : globalThis.process?.env[name])
const exit = (code) => (globalThis.Deno ? Deno.exit(code) : process.exit(code))
const runtime = globalThis.Deno ? `deno ${Deno.version.deno}` : globalThis.Bun ? `bun ${Bun.version}` : 'unknown'

globalThis.edgepgChecks(edgepg, JSON.parse(env('EDGEPG_SMOKE'))).then(
  (out) => {
    console.log(JSON.stringify({ ok: true, runtime, ...out }))
    exit(0)
  },
  (err) => {
    console.log(JSON.stringify({ ok: false, runtime, error: String(err?.stack ?? err) }))
    exit(1)
  }
)
