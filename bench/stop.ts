/**
 * `stop`: from abort to rejection, in round trips through the delay relay (100 ms RTT): edgepg's
 * AbortSignal (a CancelRequest carried in a WebSocket upgrade of its own) next to pg over TCP's
 * client.cancel (a CancelRequest on a new TCP connection). Both relays delay data only: a real
 * network adds the new connection's TCP handshake to both, and TLS to a wss:// one.
 */
import pg from 'pg'
import { Client } from '../src/index'
import { startDelayRelay } from '../test/delay-relay'
import { median, printTable, type Row, type Section } from './lib'

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
    const toEdge = await startDelayRelay({ host: '127.0.0.1', port: ctx.proxy.port }, ONE_WAY_MS)
    const toPg = await startDelayRelay({ host: ctx.pg.host, port: ctx.pg.port }, ONE_WAY_MS)
    const trips = { edgepg: [] as number[], pg: [] as number[] }
    try {
      for (let round = 0; round < ROUNDS; round++) {
        const app = `bench-stop-edge-${round}`
        const edge = new Client({ ...ctx.edgeConfig(), application_name: app, wsProxy: () => `ws://127.0.0.1:${toEdge.port}/v2` })
        await edge.connect()
        const controller = new AbortController()
        const query = edge.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any).catch(() => {})
        await running(app)
        let start = performance.now()
        controller.abort()
        await query
        trips.edgepg.push((performance.now() - start) / toEdge.rttMs)
        await edge.end()

        const tcpApp = `bench-stop-pg-${round}`
        const config = { ...ctx.pgConfig(), host: '127.0.0.1', port: toPg.port, application_name: tcpApp }
        const client = new pg.Client(config)
        await client.connect()
        const sleep: any = new pg.Query('SELECT pg_sleep(30)')
        const done = new Promise((r) => (sleep.callback = r))
        client.query(sleep)
        await running(tcpApp)
        start = performance.now()
        ;(new pg.Client(config) as any).cancel(client, sleep)
        await done
        trips.pg.push((performance.now() - start) / toPg.rttMs)
        await client.end()
      }
    } finally {
      await toEdge.close()
      await toPg.close()
      await admin.end()
    }
    const e = median(trips.edgepg)
    const p = median(trips.pg)
    const rows: Row[] = [{ metric: `abort → rejection, round trips at ${2 * ONE_WAY_MS} ms RTT (median of ${ROUNDS})`, edgepg: e.toFixed(2), baseline: p.toFixed(2), ratio: e / p }]
    printTable('stop: cancelling a running statement', rows, 'pg (TCP) client.cancel', [
      'Both stop the statement on the server; edgepg rejects with the signal\'s reason, pg with 57014. pg\'s query_timeout leaves the statement running (not comparable).',
    ])
    return rows
  },
}
