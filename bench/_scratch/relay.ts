// plain TCP relay child: node relay.ts upstreamPort listenPort
import net from 'node:net'
const [up, listen] = process.argv.slice(2).map(Number)
net.createServer({ noDelay: true }, (c) => {
  const u = net.connect({ port: up, host: '127.0.0.1', noDelay: true })
  c.pipe(u); u.pipe(c)
  c.on('error', () => u.destroy()); u.on('error', () => c.destroy())
}).listen(listen, '127.0.0.1', () => console.log('ready'))
