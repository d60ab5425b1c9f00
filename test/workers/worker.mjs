// A Cloudflare Worker (module syntax) run by test/workers.test.ts in workerd via miniflare. It imports
// the BUILT driver (dist/index.mjs; its lazy chunks are passed to miniflare as modules too) and, as
// Workers require (I/O objects cannot cross requests), creates, uses and ends its Client / Pool inside
// each request, closing in ctx.waitUntil. Bindings: PROXY_PORT, DATABASE_URL, APP (application_name prefix);
// for logins by token, TOKEN_PROXY_PORT and TABLE (the rows per user), the token in the request's ?token=;
// for reads on a lagging replica, REPLICA_PROXY_PORT and REPLICA_DATABASE_URL (a primary with a table `reads`).
import { Client, Pool, httpSql } from '../../dist/index.mjs'

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url)
    const mode = url.searchParams.get('mode')
    const n = Number(url.searchParams.get('n'))
    const wsProxy = () => `ws://127.0.0.1:${env.PROXY_PORT}/v2`
    const text = "SELECT $1::int * 2 AS doubled, $2::text AS mode, current_user AS who, current_setting('application_name') AS app"
    const params = [n, mode]
    try {
      let rows
      if (mode === 'client') {
        const client = new Client({ connectionString: env.DATABASE_URL, wsProxy, application_name: `${env.APP}-client` })
        await client.connect()
        rows = (await client.query(text, params)).rows
        ctx.waitUntil(client.end())
      } else if (mode === 'pool') {
        const pool = new Pool({ connectionString: env.DATABASE_URL, wsProxy, application_name: `${env.APP}-pool`, max: 2 })
        // Two at once: the Pool opens a second connection for the second query.
        const [a, b] = await Promise.all([pool.query(text, params), pool.query(text, [n + 1, mode])])
        rows = [...a.rows, ...b.rows]
        ctx.waitUntil(pool.end())
      } else if (mode === 'http') {
        const sql = httpSql(env.DATABASE_URL, { fetchEndpoint: `http://127.0.0.1:${env.PROXY_PORT}/sql` })
        rows = await sql.query(text, params)
      } else if (mode === 'token') {
        // By token (the request's user's), no password: a Client, then httpSql, to a proxy taking tokens.
        const { host, port, pathname } = new URL(env.DATABASE_URL)
        const where = { host: host.replace(/:\d+$/, ''), port: Number(port), database: pathname.slice(1) }
        const authToken = () => url.searchParams.get('token')
        const probe = `SELECT edgepg.claims() ->> 'sub' AS sub, current_user AS who, (SELECT array_agg(DISTINCT owner ORDER BY owner) FROM ${env.TABLE}) AS owners`
        const client = new Client({ ...where, authToken, wsProxy: () => `ws://127.0.0.1:${env.TOKEN_PROXY_PORT}/v2` })
        await client.connect()
        rows = (await client.query(probe)).rows
        ctx.waitUntil(client.end())
        const sql = httpSql(`postgres://${host}/${where.database}`, { fetchEndpoint: `http://127.0.0.1:${env.TOKEN_PROXY_PORT}/sql`, authToken })
        rows.push(...(await sql.query(probe)))
      } else if (mode === 'replica') {
        // A write, then another Client's read right after it: the position the write was told goes
        // with the read (in its own WebSocket message), which waits for the lagging standby.
        const at = { connectionString: env.REPLICA_DATABASE_URL, wsProxy: () => `ws://127.0.0.1:${env.REPLICA_PROXY_PORT}/v2` }
        const writer = new Client(at)
        await writer.connect()
        const written = (await writer.query('UPDATE reads SET n = n + 1 WHERE id = 1 RETURNING n')).rows[0].n
        await writer.end()
        const reader = new Client(at)
        await reader.connect()
        const [read] = (await reader.query('SELECT n, pg_is_in_recovery() AS replica FROM reads WHERE id = 1')).rows
        rows = [{ written, ...read, protocol: reader.connection.stream.ws?.protocol }]
        ctx.waitUntil(reader.end())
      } else {
        return Response.json({ error: `unknown mode ${mode}` }, { status: 400 })
      }
      return Response.json({ rows, userAgent: globalThis.navigator?.userAgent, hasProcess: typeof globalThis.process, hasBuffer: typeof globalThis.Buffer })
    } catch (err) {
      return Response.json({ error: String(err?.message ?? err), code: err?.code, stack: String(err?.stack ?? '') }, { status: 500 })
    }
  },
}
