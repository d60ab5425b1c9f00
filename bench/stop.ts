/**
 * `stop`: from abort to rejection, in round trips through the delay relay (100 ms RTT): edgepg's
 * AbortSignal, cancelled on the session's own WebSocket (edgepg-proxy's warm backends) and, through
 * a proxy without them, by a CancelRequest in a second WebSocket's upgrade; next to pg over TCP's
 * client.cancel (a CancelRequest on a new TCP connection). The relays delay data only: a real
 * network adds a new connection's TCP handshake (and TLS, for wss://) to the last two.
 */
import pg from 'pg'
import { Client } from '../src/index'
import { createProxy } from '../proxy/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { median, printGrid, type Section } from './lib'

const ONE_WAY_MS = 50
const ROUNDS = 5

export const stop: Section = {
  name: 'stop',
  async run(ctx) {
    const admin = new pg.Client(ctx.pgConfig())
    await admin.connect()
    const running = async (app: string) => {
      for (let i = 0; i < 400; i++) {
        const { rows } = await admin.query(`SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND state = 'active' AND query LIKE '%pg_sleep%'`, [app])
        if (rows.length) return
        await new Promise((r) => setTimeout(r, 10))
      }
      throw new Error(`bench stop: ${app}'s statement never ran`)
    }
    const noPool = createProxy({ upstream: `${ctx.pg.host}:${ctx.pg.port}`, pool: { enabled: false } })
    const noPoolPort = (await noPool.listen(0, '127.0.0.1')).port
    const toEdge = await startDelayRelay({ host: '127.0.0.1', port: ctx.proxy.port }, ONE_WAY_MS)
    const toSecond = await startDelayRelay({ host: '127.0.0.1', port: noPoolPort }, ONE_WAY_MS)
    const toPg = await startDelayRelay({ host: ctx.pg.host, port: ctx.pg.port }, ONE_WAY_MS)
    const trips = { session: [] as number[], second: [] as number[], pg: [] as number[] }
    try {
      for (let round = 0; round < ROUNDS; round++) {
        for (const [path, relay] of [['session', toEdge], ['second', toSecond]] as const) {
          const app = `bench-stop-${path}-${round}`
          const edge = new Client({ ...ctx.edgeConfig(), application_name: app, wsProxy: () => `ws://127.0.0.1:${relay.port}/v2` })
          await edge.connect()
          const controller = new AbortController()
          const query = edge.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any).catch(() => {})
          await running(app)
          const start = performance.now()
          controller.abort()
          await query
          trips[path].push((performance.now() - start) / relay.rttMs)
          await edge.end()
        }

        const tcpApp = `bench-stop-pg-${round}`
        const config = { ...ctx.pgConfig(), host: '127.0.0.1', port: toPg.port, application_name: tcpApp }
        const client = new pg.Client(config)
        await client.connect()
        const sleep: any = new pg.Query('SELECT pg_sleep(30)')
        const done = new Promise((r) => (sleep.callback = r))
        client.query(sleep)
        await running(tcpApp)
        const start = performance.now()
        ;(new pg.Client(config) as any).cancel(client, sleep)
        await done
        trips.pg.push((performance.now() - start) / toPg.rttMs)
        await client.end()
      }
    } finally {
      await Promise.all([toEdge.close(), toSecond.close(), toPg.close(), noPool.close()])
      await admin.end()
    }
    printGrid('stop: cancelling a running statement', ['metric', "edgepg, on the session's WebSocket", 'edgepg, a second WebSocket', 'pg (TCP) client.cancel'], [
      [`abort → rejection, round trips at ${2 * ONE_WAY_MS} ms RTT (median of ${ROUNDS})`, ...[trips.session, trips.second, trips.pg].map((t) => median(t).toFixed(2))],
    ], ["All three stop the statement on the server; edgepg rejects with the signal's reason, pg with 57014. pg's query_timeout leaves the statement running (not comparable)."])
    return []
  },
}
